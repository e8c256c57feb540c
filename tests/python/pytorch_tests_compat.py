"""A pytest plugin loaded by run_pytorch_tests.py for both allocators: the names PyTorch's
test files import that the installed PyTorch has renamed, and the tests deselected because
under the installed PyTorch they break every test after them (the test files come from a code
index that may hold another version than the installed one). Changes no behaviour."""
import torch.testing._internal.inductor_utils as inductor_utils

if not hasattr(inductor_utils, "HAS_CUDA"):
    inductor_utils.HAS_CUDA = inductor_utils.HAS_CUDA_AND_TRITON

import torch.testing._internal.common_utils as common_utils  # noqa: E402

if not hasattr(common_utils, "TEST_CUDAMALLOCASYNC"):  # never run under that backend here
    common_utils.TEST_CUDAMALLOCASYNC = False

# Tests of a later PyTorch than the installed one whose failure under the installed one leaves
# the process unusable for every test after it, with either allocator. With 2.11, the tests of
# graph-safe RNG (a generator's offsets per capture) fail inside their captures ("Offset
# increment outside graph capture encountered unexpectedly", "Attempt to increase offset for a
# CUDA generator not in capture mode") and leave a stream capturing: every later CUDA call of
# the process fails with "operation not permitted when stream is capturing". The whole family
# is deselected for both allocators (pytest reports them as deselected, none counts as
# passed); RNG state under capture is no concern of the allocator.
def poisons_later_tests(name):
    return name.startswith("test_graph_rng_") or name == "test_graphsafe_set_get_rng_state"


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        (dropped if poisons_later_tests(item.name) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
