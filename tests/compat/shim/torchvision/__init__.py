"""Test-only stand-in for torchvision: the parts Ray's PyTorch examples use, with FashionMNIST as
synthetic data of the real shape (28x28 images, 10 classes) instead of a download.

On sys.path only for the compatibility suite's runs of Ray's example scripts. The number of
images is OUTLAST_SHIM_DATASET_SIZE (default 256), so that an example's epochs take a step or two.
"""

from torchvision import datasets, transforms  # noqa: F401

__version__ = "0.0+outlast.test.shim"
