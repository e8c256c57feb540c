"""A pytest plugin loaded by run_pytorch_tests.py for both allocators: the names PyTorch's
test files import that the installed PyTorch has renamed (the test files come from a code
index that may hold another version than the installed one). Changes no behaviour."""
import torch.testing._internal.inductor_utils as inductor_utils

if not hasattr(inductor_utils, "HAS_CUDA"):
    inductor_utils.HAS_CUDA = inductor_utils.HAS_CUDA_AND_TRITON

import torch.testing._internal.common_utils as common_utils  # noqa: E402

if not hasattr(common_utils, "TEST_CUDAMALLOCASYNC"):  # never run under that backend here
    common_utils.TEST_CUDAMALLOCASYNC = False
