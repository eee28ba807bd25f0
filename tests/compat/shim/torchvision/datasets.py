import os

import torch
from torch.utils.data import Dataset


class FashionMNIST(Dataset):
    """Same shape and item types as torchvision's (a PIL-free uint8 image; the transform gets it)."""

    def __init__(self, root, train=True, download=False, transform=None, target_transform=None):
        size = int(os.environ.get("OUTLAST_SHIM_DATASET_SIZE", "256"))
        g = torch.Generator().manual_seed(0 if train else 1)
        self.data = torch.randint(0, 256, (size, 28, 28), dtype=torch.uint8, generator=g)
        self.targets = torch.randint(0, 10, (size,), generator=g)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        image, target = self.data[i], int(self.targets[i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
