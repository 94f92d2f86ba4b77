"""obow's version (``obow.__version__``), on the bottom floor of the package, so that a module of any floor can write
it into what it makes (an exported file's metadata) without importing the package's face."""

__version__ = "0.1.0"
