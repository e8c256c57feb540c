"""Child of test_torch_graphs.py: runs the CUDA-graph checks with one allocator (argv[1]:
`vram` for vram_torch.enable(), `torch` for PyTorch's own) and prints one RESULT line
(JSON) per check. Not a test file by itself."""
import json
import sys
import traceback

import torch

MODE = sys.argv[1]
if MODE == "vram":
    import vram_torch

    vram_torch.enable()

MiB = 1 << 20
SENTINEL = 7.0


def result(check, **fields):
    print("RESULT " + json.dumps({"check": check, "mode": MODE, **fields}), flush=True)


def graph_bytes():
    return vram_torch.stats()["vram.graph_pool_bytes"] if MODE == "vram" else None


def mlp(width=1024, hidden=4096, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, width)).cuda()


def warm_up(fn, *args):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def sentinels(count=8, nbytes=4 * MiB):
    """Tensors allocated after a capture, the size of its freed intermediates."""
    return [torch.full((nbytes // 4,), SENTINEL, device="cuda") for _ in range(count)]


def clobbered(tensors):
    return sum(int((t != SENTINEL).any().item()) for t in tensors)


def check_mlp_clobber(replays=30):
    """A captured MLP frees its 4 MiB intermediates inside the capture; tensors allocated
    after the capture must never be written by a replay."""
    model = mlp()
    x = torch.randn(256, 1024, device="cuda")
    with torch.no_grad():
        eager = model(x).clone()
        warm_up(model, x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = model(x)
        held = graph_bytes()
        bad_replays = 0
        max_diff = 0.0
        for _ in range(replays):
            after = sentinels()
            g.replay()
            torch.cuda.synchronize()
            bad_replays += clobbered(after) != 0
            max_diff = max(max_diff, float((y - eager).abs().max().item()))
            del after
    del g, y
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per stream, allocated in the capture; it holds the pool until
    # cleared (as in PyTorch). Released pools rejoin the shared pool at empty_cache.
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    result("mlp_clobber", replays=replays, clobbered_replays=bad_replays, max_diff=max_diff,
           graph_pool_bytes_captured=held, graph_pool_bytes_after_reset=graph_bytes())


def check_pool_sharing(replays=10):
    """Two graphs share one pool (pool=): the second reads the first's output; memory goes
    back only when both are released."""
    first, second = mlp(seed=1), mlp(seed=2)
    x = torch.randn(256, 1024, device="cuda")
    with torch.no_grad():
        eager = second(first(x)).clone()
        warm_up(lambda v: second(first(v)), x)
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1):
            h = first(x)
        with torch.cuda.graph(g2, pool=g1.pool()):
            y = second(h)
        bad_replays = 0
        max_diff = 0.0
        for _ in range(replays):
            after = sentinels()
            g1.replay()
            g2.replay()
            torch.cuda.synchronize()
            bad_replays += clobbered(after) != 0
            max_diff = max(max_diff, float((y - eager).abs().max().item()))
            del after
    held_both = graph_bytes()
    g1.reset()
    del h
    held_one = graph_bytes()
    out = y.clone()
    g2.reset()
    del y
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    result("pool_sharing", replays=replays, clobbered_replays=bad_replays, max_diff=max_diff,
           graph_pool_bytes_both=held_both, graph_pool_bytes_one_released=held_one,
           graph_pool_bytes_both_released=graph_bytes(),
           output_after_release_ok=bool(torch.allclose(out, eager, atol=1e-5)))


def check_make_graphed_callables(steps=20):
    """make_graphed_callables on a small model trained with backward: the same losses and
    parameters as the same training run eagerly."""
    torch.manual_seed(3)
    data = [(torch.randn(64, 512, device="cuda"), torch.randn(64, 512, device="cuda"))
            for _ in range(steps)]

    def build():
        torch.manual_seed(4)
        return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                   torch.nn.Linear(2048, 512)).cuda()

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        for x, target in data:
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
        return losses

    eager_model = build()
    eager_losses = train(eager_model)
    graphed_model = build()
    graphed = torch.cuda.make_graphed_callables(
        graphed_model, (torch.randn(64, 512, device="cuda", requires_grad=False),))
    after = sentinels(4)
    graphed_losses = train(graphed)
    torch.cuda.synchronize()
    max_loss_diff = max(abs(a - b) for a, b in zip(eager_losses, graphed_losses))
    max_param_diff = max(float((p - q).abs().max().item())
                         for p, q in zip(eager_model.parameters(), graphed_model.parameters()))
    result("make_graphed_callables", steps=steps, max_loss_diff=max_loss_diff,
           graphed_losses=graphed_losses,
           max_param_diff=max_param_diff, clobbered_sentinels=clobbered(after),
           first_loss=eager_losses[0], last_loss=eager_losses[-1])


def check_reduce_overhead(calls=5):
    """torch.compile(mode='reduce-overhead') (CUDA graph trees) on an MLP: outputs equal
    eager, for two input shapes in turn (a graph each, the allocator's pool checkpointed)."""
    model = mlp(width=256, hidden=1024, seed=5)
    xs = [torch.randn(32, 256, device="cuda"), torch.randn(8, 256, device="cuda")]
    with torch.no_grad():
        eager = [model(x).clone() for x in xs]
        compiled = torch.compile(model, mode="reduce-overhead")
        try:
            max_diff = 0.0
            for i in range(calls * 2):
                y = compiled(xs[i % 2])
                max_diff = max(max_diff, float((y - eager[i % 2]).abs().max().item()))
            result("reduce_overhead", raised=None, max_diff=max_diff)
        except Exception as e:  # noqa: BLE001
            result("reduce_overhead", raised=type(e).__name__, text=str(e)[:600])


def check_reduce_overhead_training(steps=6):
    """A small transformer trained with torch.compile(mode='reduce-overhead'): forward and
    backward graphs replayed every step; losses equal eager training's (same rounding
    tolerance as PyTorch's own allocator shows) and no output clobbered."""
    def build():
        torch.manual_seed(11)
        return torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True),
            2).cuda()

    torch.manual_seed(12)
    batches = [torch.randn(4, 32, 128, device="cuda") for _ in range(steps)]

    def train(model, compiled):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        fn = torch.compile(model, mode="reduce-overhead") if compiled else model
        losses = []
        for x in batches:
            torch.compiler.cudagraph_mark_step_begin()
            loss = fn(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.item()))
        return losses

    eager = train(build(), False)
    try:
        graphed = train(build(), True)
        max_diff = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(eager, graphed))
        result("reduce_overhead_training", raised=None, max_rel_diff=max_diff, eager=eager,
               graphed=graphed)
    except Exception as e:  # noqa: BLE001
        result("reduce_overhead_training", raised=type(e).__name__, text=str(e)[:600])


for check in (check_mlp_clobber, check_pool_sharing, check_make_graphed_callables,
              check_reduce_overhead, check_reduce_overhead_training):
    try:
        check()
    except Exception as e:  # noqa: BLE001
        result(check.__name__[len("check_"):], error=f"{type(e).__name__}: {e}",
               trace=traceback.format_exc()[-1500:])
