"""The Dataset the test training scripts share: random samples, each taking load_ms to load."""
import time

import torch
from torch.utils.data import Dataset


class SyntheticDataset(Dataset):
    def __init__(self, size, features, load_ms=0.0, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, features, generator=generator)
        self.targets = torch.randint(0, 10, (size,), generator=generator)
        self.load_s = load_ms / 1000.0

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        if self.load_s:
            time.sleep(self.load_s)  # decoding, augmenting, reading from a slow disk
        return self.inputs[index], self.targets[index]
