"""Features of a backbone exported by ``obow export``, for a downstream task: here a scikit-learn classifier.

    obow export --checkpoint runs/x/checkpoint.pt --out backbone.pth
    python examples/extract_features.py --backbone backbone.pth --data DIR

DIR holds train/ and test/ (or val/) class folders. The images are seen as the pretraining recipe's teacher
view (resize, centre crop, normalisation: from the export's backbone.pth.json sidecar), the features are the
backbone's pool5 (global average of conv5), and a logistic regression learns the classes from them.
"""

import argparse
from pathlib import Path

import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from torch.utils.data import DataLoader
from torchvision import transforms

from obow import ImageFolder, load_backbone

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--backbone", required=True, help="a file written by obow export (with its .json sidecar)")
parser.add_argument("--data", required=True, help="a folder with train/ and test/ (or val/) class folders")
args = parser.parse_args()

backbone, info = load_backbone(backbone_file=args.backbone)  # the architecture comes from the sidecar
backbone.eval()
view = info["views"]  # the recipe's teacher view
transform = transforms.Compose(
    [
        transforms.Resize(view["teacher_resize"]),
        transforms.CenterCrop(view["teacher_size"]),
        transforms.ToTensor(),
        transforms.Normalize(view["mean"], view["std"]),
    ]
)


@torch.no_grad()
def features(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    dataset = ImageFolder(folder, transform=transform, labels="folders")  # read as obow eval reads it
    batches = [(backbone(x).pool5, y) for x, y in DataLoader(dataset, batch_size=256)]
    return torch.cat([f for f, _ in batches]), torch.cat([y for _, y in batches])


root = Path(args.data)
test_folder = root / "test" if (root / "test").is_dir() else root / "val"
if not (root / "train").is_dir() or not test_folder.is_dir():
    raise SystemExit(f"{root} needs train/ and test/ (or val/) folders of class sub-folders, e.g. {root}/train/cat/")
x_train, y_train = features(root / "train")
x_test, y_test = features(test_folder)
print(f"{info['arch']} features: {tuple(x_train.shape)} for training, {tuple(x_test.shape)} for testing")

scaler = StandardScaler().fit(x_train.numpy())
classifier = LogisticRegression(max_iter=1000).fit(scaler.transform(x_train.numpy()), y_train.numpy())
accuracy = classifier.score(scaler.transform(x_test.numpy()), y_test.numpy())
print(f"logistic regression on the pretrained features: {100 * accuracy:.1f}% top-1 on {len(y_test)} test images")
