"""The PyTorch digits/MNIST training of ``pytorch_mnist.py``, its ranks run as Ray actors by ``RayExecutor``.

On a local Ray started here on 127.0.0.1 (2 workers, scikit-learn's bundled
digits; nothing to download)::

    python examples/ray_pytorch_mnist.py --num-workers 2 --epochs 3

On a running Ray cluster: ``--address auto`` (or the head's address).
Options after ``--`` go to the training (``pytorch_mnist.py``'s options,
e.g. ``-- --lr 0.05 --dataset mnist --data-dir ~/data/mnist``).
"""

from __future__ import annotations

import argparse
import os
import sys

import ray

from roundel.ray import RayExecutor

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


def train(argv: list[str], examples_dir: str) -> dict:
    """One rank's training (run inside its actor): ``pytorch_mnist.py``'s recipe, returning the metrics."""
    sys.path.insert(0, examples_dir)  # pytorch_mnist.py, datasets.py and models.py, as on the driver
    import torch
    import torch.optim as optim
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import pytorch_mnist as recipe
    import roundel.torch as hvd
    from datasets import load_dataset
    from models import MnistNet

    args = recipe.parse_args(argv)
    args.progress = "none"  # actors have no terminal; rank 0 prints a line per epoch instead
    hvd.init()
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    train_set, test_set = load_dataset(args.dataset, args.data_dir)
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True,
                                       seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)
    model = MnistNet().to(device)
    optimizer = hvd.DistributedOptimizer(
        optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum),
        named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for epoch in range(1, args.epochs + 1):
        train_loss, train_accuracy = recipe.train_epoch(epoch, model, optimizer, train_loader, train_sampler,
                                                        device, args)
        test_loss, test_accuracy = recipe.evaluate(model, test_loader, device)
        recipe.say(f"epoch {epoch}: train loss {train_loss:.4f} accuracy {train_accuracy:.4f} | "
                   f"test loss {test_loss:.4f} accuracy {test_accuracy:.4f}")
    return {"rank": hvd.rank(), "size": hvd.size(), "test_accuracy": test_accuracy, "test_loss": test_loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-workers", type=int, default=2, help="ranks (Ray actors, one CPU each)")
    p.add_argument("--epochs", type=int, default=3, help="epochs to train")
    p.add_argument("--address", help="a running Ray cluster's address (default: start Ray here on 127.0.0.1)")
    p.add_argument("training", nargs=argparse.REMAINDER, help="after --: options for pytorch_mnist.py's training")
    args = p.parse_args()
    extra = args.training[1:] if args.training[:1] == ["--"] else args.training
    if args.address:
        ray.init(address=args.address)
    else:  # a Ray of our own, reachable on loopback only
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=args.num_workers, include_dashboard=False,
                 object_store_memory=100 * 1024 * 1024)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=args.num_workers)
    executor.start()
    try:
        results = executor.run(train, args=[["--epochs", str(args.epochs), *extra], EXAMPLES])
    finally:
        executor.shutdown()
        ray.shutdown()
    for r in results:
        print(f"rank {r['rank']} of {r['size']}: test accuracy {r['test_accuracy']:.4f}, "
              f"test loss {r['test_loss']:.4f}")
    print(f"final test accuracy: {results[0]['test_accuracy']:.4f}")


if __name__ == "__main__":
    main()
