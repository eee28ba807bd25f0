import torch


class ToTensor:
    """A uint8 HxW image to a float 1xHxW tensor in [0, 1], as torchvision's does for a grayscale image."""

    def __call__(self, image):
        return image.to(torch.float32).div(255).unsqueeze(0)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __call__(self, tensor):
        return (tensor - self.mean) / self.std


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x
