"""OBoW pretraining in a plain PyTorch loop of your own: obow's model and views, your dataset, loader and optimiser.

    python examples/pretrain_loop.py --data DIR --out backbone.pt

DIR is any folder of images, with class sub-folders or without (``obow.ImageFolder`` reads it as ``obow pretrain``
does; the labels are not used). The model and the views follow a built-in recipe (``--config``, default
``cifar10_fast``: CIFAR-10-sized images); ``obow pretrain`` does the same with checkpoints, resuming, logs and
several GPUs.
"""

import argparse

import torch
from torch.utils.data import DataLoader

from obow import ImageFolder, OBoW, OBoWViews, load_config

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", required=True, help="a folder of images (class sub-folders or not)")
parser.add_argument("--config", default="cifar10_fast", help="a built-in recipe name or a YAML file")
parser.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
parser.add_argument("--batch-size", type=int, default=None, help="default: the recipe's")
parser.add_argument("--workers", type=int, default=2, help="data-loading processes")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (a quick check)")
parser.add_argument("--out", default="backbone.pt", help="where to save the student's weights")
args = parser.parse_args()

cfg = load_config(args.config)  # cfg.model: network, levels, vocabulary; cfg.views: the paper's views, scaled
epochs = args.epochs or cfg.optim.epochs
batch_size = args.batch_size or cfg.data.batch_size
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Each image becomes {"teacher": [3, T, T], "crops": [2, 3, c, c], "patches": [5, 3, p, p]}.
dataset = ImageFolder(args.data, transform=OBoWViews(cfg.views))
loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=args.workers)
if len(loader) == 0:
    raise SystemExit(f"{args.data} holds fewer images ({len(dataset)}) than one batch ({batch_size})")

total_steps = epochs * len(loader)
torch.manual_seed(args.seed)  # the initial weights and vocabularies, and the views
model = OBoW.from_config(cfg.model, total_iterations=total_steps).to(device)  # student, EMA teacher, BoW head
params = [p for p in model.parameters() if p.requires_grad]
optim = cfg.optim  # the recipe's SGD settings; a cosine schedule without its warm-up
optimizer = torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps, eta_min=optim.end_lr)

step = 0
model.train()
for epoch in range(epochs):
    for views, _ in loader:
        teacher = views["teacher"].to(device)
        student = [views[k].to(device) for k in ("crops", "patches") if k in views]
        out = model(teacher, student)  # teacher EMA update, BoW targets, vocabulary update, student loss
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1
        if args.max_steps is not None and step >= args.max_steps:
            break
    print(f"epoch {epoch + 1}: loss {out.metrics['loss']:.3f} (step {step} of {total_steps})")
    if args.max_steps is not None and step >= args.max_steps:
        break

torch.save(model.student.state_dict(), args.out)  # the pretrained backbone (an obow ResNetBackbone)
print(f"saved the student's weights to {args.out}")
