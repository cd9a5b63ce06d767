"""Rank 1 trains a model whose last layer is wider than rank 0's; each rank prints the error ``step()`` raised.

Argument: ``named`` (``named_parameters=`` given) or ``unnamed``. Prints
``CAUGHT <type> <is a RuntimeError>: <message>`` on one line and exits 0, so
the test reads what a user would catch.
"""

import sys

import torch

import roundel.torch as hvd

hvd.init()
torch.manual_seed(0)
width = 3 if hvd.rank() == 0 else 5  # rank 1 disagrees on the last layer's width
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, width))
names = {"named_parameters": model.named_parameters()} if sys.argv[1] == "named" else {}
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **names)
loss = model(torch.randn(4, 6)).pow(2).mean()
try:
    loss.backward()
    optimizer.step()
except Exception as exc:  # what Horovod users catch: HorovodInternalError / RuntimeError
    print(f"CAUGHT {type(exc).__name__} {isinstance(exc, RuntimeError)}: {exc}".replace("\n", " | "), flush=True)
else:
    print("NO ERROR", flush=True)
hvd.shutdown()
