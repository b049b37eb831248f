"""Deep-dive on a small transformer: per-layer time and exact saved memory; OOM post-mortem;
FLOPs from the sampled steps' shapes."""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from conftest import SCRIPTS
from test_live_verdict import assert_live_is_final
from test_probe import patches, probe  # noqa: F401 (the fixtures)
from traceml.probe.layers import LayerProbe

TRANSFORMER = SCRIPTS / "tiny_transformer.py"
BATCH, SEQ, WIDTH = 4, 16, 64


def test_every_linear_has_time_and_its_exact_saved_input(traceml_run):
    run = traceml_run("--steps", 40, "--blocks", 2, script=TRANSFORMER, traceml_args=("--deep",))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    layers = {row["name"]: row for row in summary["layers"]}
    linears = [row for row in summary["layers"] if row["type"] == "Linear"]
    assert {row["name"] for row in linears} == {"blocks.0.up", "blocks.0.down", "blocks.1.up",
                                                "blocks.1.down", "head"}
    for row in linears:
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0, row
        assert row["calls_per_step"] == 1
    # nn.Linear saves its input for the weight's gradient: tokens x in_features x 4 bytes.
    tokens = BATCH * SEQ
    assert layers["blocks.0.up"]["memory_bytes"] == tokens * WIDTH * 4
    assert layers["blocks.0.down"]["memory_bytes"] == tokens * 4 * WIDTH * 4
    assert layers["head"]["memory_bytes"] == tokens * WIDTH * 4
    assert layers["blocks.0.up"]["output_bytes"] == tokens * 4 * WIDTH * 4
    # Parents include their children; the model's root covers the whole forward.
    assert layers["TinyTransformer"]["forward_ms"] >= layers["blocks.0"]["forward_ms"] >= layers["blocks.0.up"]["forward_ms"]
    deep = summary["deep_dive"]
    assert deep["every_n_steps"] == 10 and deep["sampled_steps"] == 3  # steps 10, 20, 30
    assert 0.0 < deep["forward_coverage"] < 1.0  # attention runs as functional code in its parent
    card = (run.run_dir / "final_summary.txt").read_text()
    assert "top by time" in card and "top by memory" in card and "deep-dive every 10 steps" in card
    assert max(len(line) for line in card.splitlines()) <= 100


def test_a_module_called_twice_a_step_is_summed_with_its_count(traceml_run, tmp_path):
    script = tmp_path / "shared_layer.py"
    script.write_text(
        "import torch, traceml\n"
        "from torch import nn\n"
        "shared = nn.Linear(8, 8)\n"
        "model = nn.ModuleDict({'shared': shared})\n"
        "class Twice(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.shared = shared\n"
        "    def forward(self, x):\n"
        "        return self.shared(torch.relu(self.shared(x)))\n"
        "net = Twice()\n"
        "traceml.trace_model_instance(net, every_n_steps=2)\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "for _ in range(12):\n"
        "    with traceml.trace_step(net):\n"
        "        loss = net(torch.randn(5, 8)).sum(); opt.zero_grad(); loss.backward(); opt.step()\n")
    run = traceml_run(script=script)
    assert run.returncode == 0, run.stderr
    layers = {row["name"]: row for row in run.summary()["layers"]}
    assert layers["shared"]["calls_per_step"] == 2
    assert layers["shared"]["memory_bytes"] == 2 * 5 * 8 * 4  # each call saves its own input


def test_out_of_memory_inside_a_layer_is_explained_and_reraised(traceml_run):
    run = traceml_run("--steps", 40, "--deep-every", 5, "--oom-at", 12, script=TRANSFORMER)
    assert run.returncode == 1
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB" in run.stderr
    summary = run.summary()
    primary = summary["primary_diagnosis"]
    assert primary["kind"] == "MEMORY_PRESSURE" and primary["severity"] == "crit"
    evidence = primary["evidence"]
    assert evidence["oom"] is True and evidence["step"] == 12
    assert evidence["phase"] == "forward" and evidence["layer"] == "guard"
    assert "out of memory at step 12" in primary["summary"] and "inside layer guard" in primary["summary"]
    assert "largest layers by saved activations: blocks." in primary["summary"]
    assert summary["steps"]["count"] == 12
    assert_live_is_final(run)  # the live views end on the card's verdict


def test_deep_dive_names_the_layers_a_leak_keeps_alive(traceml_run):
    run = traceml_run("--steps", 60, "--no-loader", "--keep-graph", "--batch-size", 256,
                      "--features", 256, "--width", 1024, traceml_args=("--deep",))
    assert run.returncode == 0, run.stderr
    creep = next(f for f in run.summary()["findings"] if f["kind"] == "MEMORY_CREEP")
    # The loop keeps each step's outputs: the last layer's output outlives its step.
    assert "layers whose outputs or saved tensors outlive the step: 4 (" in creep["summary"]
    assert any(row["alive_bytes"] > 0 for row in run.summary()["layers"])


def test_a_gpt_script_under_deep_dive_ranks_its_linears_and_explains_its_coverage(traceml_run):
    """The unmodified GPT-style script: p=0 Dropouts after the projections, attention through
    F.scaled_dot_product_attention, residual connections, a tied head."""
    # Seven sampled steps (every 10th): a layer's figure is the mean of its seven calls.
    run = traceml_run("--steps", 80, script=SCRIPTS / "gpt_deep.py", traceml_args=("--deep",))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    leaves = [row for row in summary["layers"] if row["leaf"]]
    by_time = sorted(leaves, key=lambda row: -(row["forward_ms"] + row["backward_ms"]))
    # The slowest are Linears. One place in four is left to the machine, the first included: on
    # a busy one, a preemption of a few milliseconds inside a 0.2 ms GELU in one of its seven
    # calls is what a wall clock sees there, and lifts it among layers a few tenths of a
    # millisecond apart.
    assert sum(row["type"] == "Linear" for row in by_time[:4]) >= 3, by_time[:4]
    for dropout in (row for row in leaves if row["type"] == "Dropout"):
        assert dropout["backward_ms"] == 0.0  # its output is its input: no backward of its own
    deep = summary["deep_dive"]
    assert 0.5 < deep["forward_coverage"] < 0.98 and 0.5 < deep["backward_coverage"] < 0.98
    card = (run.run_dir / "final_summary.txt").read_text()
    top = card[card.index("top by time"):card.index("top by memory")]
    assert "Dropout" not in top


class ConvAndLinears(nn.Module):
    """Every product in a module: convolutions, a transposed convolution, a frozen Linear over
    (batch, tokens, channels) and a block recomputed in backward (checkpointed)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.middle = nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.frozen = nn.Linear(4, 16).requires_grad_(False)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, images):
        features = torch.relu(self.up(torch.relu(self.middle(torch.relu(self.stem(images))))))
        tokens = self.frozen(features.flatten(2).transpose(1, 2))
        tokens = checkpoint(self.block, tokens, use_reentrant=False)
        return self.head(tokens).mean()


def sampled_flops(patches, model, inputs):
    """Deep-dive's FLOPs a step over five steps of model(inputs).backward(), two of them sampled."""
    probe = patches.probe
    patches.hook_model(model)
    probe.layers = LayerProbe(probe, model, every_n_steps=2)
    for _ in range(5):
        with probe:
            model(inputs).sum().backward()
    assert probe.layers.sampled_steps == 2
    return probe.layers.flops_per_step


def test_flops_from_the_sampled_steps_shapes_are_torchs_count_of_the_same_step(patches):
    """What torch's FlopCounterMode counts for a step of a model whose products all run in
    modules (backward's, and the checkpointed block's recompute, included), without that mode
    anywhere near the traced steps."""
    torch.manual_seed(0)
    model, images = ConvAndLinears(), torch.randn(2, 3, 8, 8)
    with FlopCounterMode(display=False) as counter:
        model(images).backward()
    assert sampled_flops(patches, model, images) == counter.get_total_flops() > 0


def test_a_grouped_convolution_counts_a_groupth_of_its_products(patches):
    """(torch's counter counts its weight gradient as if ungrouped, 4 times too many here.)"""
    conv = nn.Conv2d(8, 8, 3, padding=1, groups=4)
    inputs = torch.randn(2, 8, 8, 8, requires_grad=True)
    forward = 2 * (2 * 8 * 8 * 8) * (8 // 4) * 3 * 3  # 2 x output elements x products each
    assert sampled_flops(patches, conv, inputs) == 3 * forward  # and the input's and weight's gradients
