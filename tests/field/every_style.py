"""One seeded loop, traced in each way TraceML offers (or not at all), that then hands its model
to everything a user might: pickle, torch.save (model and state_dict), copy.deepcopy,
torch.jit.script, torch.compile, and a look at type(model) and model.__dict__. Run it plain and
traced; every file it writes and every line it prints must be the same.

    python every_style.py --out DIR --how plain|trace_step|trace_api|deep
    (zero-code mode: --how plain under `traceml run`)
"""
import argparse
import contextlib
import copy
import hashlib
import io
import os
import pickle

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 32))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 5)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.features(inputs))))


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class NamesRecorded(pickle.Unpickler):
    """Unpickles, noting every class and function the pickle names (its tensors' storage keys
    are addresses, so the bytes differ from one process to the next even without TraceML)."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.names = set()

    def find_class(self, module, name):
        self.names.add(f"{module}.{name}")
        return super().find_class(module, name)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--how", choices=("plain", "trace_step", "trace_api", "deep"), default="plain")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)

    model = Classifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = torch.randn(args.steps * 8, 20)
    labels = (inputs[:, :5].argmax(dim=1))
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(1))

    region = contextlib.nullcontext()
    step_context = lambda: contextlib.nullcontext()  # noqa: E731
    if args.how in ("trace_step", "deep"):
        import traceml

        if args.how == "deep":
            traceml.trace_model_instance(model, every_n_steps=2)
        step_context = lambda: traceml.trace_step(model)  # noqa: E731
    elif args.how == "trace_api":
        import traceml

        region = traceml.Trace().trace("every_style")

    with region:
        for batch, target in loader:
            with step_context():
                loss = nn.functional.cross_entropy(model(batch), target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    print(f"loss {loss.item():.6f}")

    probe = torch.randn(4, 20, generator=torch.Generator().manual_seed(2))
    model.eval()
    torch.save(model, os.path.join(args.out, "model.pt"))
    torch.save(model.state_dict(), os.path.join(args.out, "state.pt"))
    torch.save(optimizer.state_dict(), os.path.join(args.out, "optimizer.pt"))
    torch.save(copy.deepcopy(model), os.path.join(args.out, "deepcopy.pt"))
    print("type", type(model).__module__, type(model).__qualname__)
    print("instance attributes", sorted(vars(model)))
    print("state keys", list(model.state_dict()))
    pickled = pickle.dumps(model)
    unpickler = NamesRecorded(pickled)
    unpickled = unpickler.load()
    print("pickle names", sorted(unpickler.names))
    print("unpickled output", digest(unpickled(probe).detach().numpy().tobytes()))
    reloaded = torch.load(os.path.join(args.out, "model.pt"), weights_only=False)
    print("reloaded output", digest(reloaded(probe).detach().numpy().tobytes()))
    with torch.serialization.safe_globals([Classifier, nn.Sequential, nn.Linear, nn.ReLU, nn.Dropout,
                                           nn.LayerNorm]):
        safe = torch.load(os.path.join(args.out, "model.pt"))
    print("weights_only load output", digest(safe(probe).detach().numpy().tobytes()))
    scripted = torch.jit.script(model)
    print("scripted output", digest(scripted(probe).detach().numpy().tobytes()))
    print("scripted code", digest(scripted.code.encode()))
    compiled = torch.compile(model, backend="eager")
    print("compiled output", digest(compiled(probe).detach().numpy().tobytes()))
    from torch._dynamo.utils import counters

    print("compiled graphs", counters["stats"]["unique_graphs"], "graph breaks",
          sum(counters["graph_break"].values()))
    print(f"updates {len(loader)}")


if __name__ == "__main__":
    main()
