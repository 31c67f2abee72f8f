import os
import sys

import torch

# The tests import the package from the repository root, without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Two cores on CI: one intra-op thread per process is as fast for the small
# models the tests build, and keeps timings steady.
torch.set_num_threads(1)
