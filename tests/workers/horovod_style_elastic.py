"""An elastic training script written the way Horovod 0.28.1's elastic test scripts are, for the scenarios of
tests/horovod_elastic_scenarios.py.

It takes the arguments Horovod's ``elastic_torch_main.py`` and
``elastic_tensorflow2_main.py`` take and leans on what they lean on: the
identity in ``HOROVOD_RANK``/``HOROVOD_HOSTNAME`` after ``init()``, rank 0
waiting for the driver's notice in ``state._host_messages`` when the
schedule says the hosts change, ``state._last_updated_timestamp``, failures
raised or by SIGKILL, and (TensorFlow) a reset callback that assigns
``optimizer.lr``, the Keras 2 name. Rank 0 appends one JSON line per epoch
to ``--logfile``. ``--framework torch`` (default) or ``tensorflow``.
"""

import argparse
import json
import os
import time

import psutil

parser = argparse.ArgumentParser()
parser.add_argument("--framework", choices=["torch", "tensorflow"], default="torch")
parser.add_argument("--logfile", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batches-per-epoch", type=int, default=10)
parser.add_argument("--epoch-wait", type=float, default=0.0)
parser.add_argument("--discovery-schedule", default="[]")
parser.add_argument("--discovery-wait", type=float, default=3.0)
parser.add_argument("--exit-schedule", default="{}")
parser.add_argument("--exit-mode", choices=["exception", "kill"], default="exception")
args = parser.parse_args()

BASE_LR = 0.01

if args.framework == "torch":
    import torch

    import roundel.torch as hvd

    hvd.init()
    inputs, labels = torch.randn(16, 3), torch.randint(0, 2, (16,))
    model = torch.nn.Linear(3, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size()),
                                         named_parameters=model.named_parameters())

    def train_step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    def rescale_lr():
        for group in optimizer.param_groups:
            group["lr"] = BASE_LR * hvd.size()

    def make_state(**counters):
        return hvd.elastic.TorchState(model, optimizer, **counters)
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    import tensorflow as tf

    import roundel.tensorflow as hvd

    hvd.init()
    inputs = tf.random.uniform([16, 3])
    labels = tf.one_hot(tf.random.uniform([16], maxval=2, dtype=tf.int64), 2)
    model = tf.keras.Sequential([tf.keras.Input([3]), tf.keras.layers.Dense(2, activation="softmax")])
    optimizer = tf.keras.optimizers.SGD(BASE_LR * hvd.size())

    @tf.function
    def train_step(reduce=True):
        with tf.GradientTape() as tape:
            loss = tf.keras.losses.categorical_crossentropy(labels, model(inputs, training=True))
        if reduce:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    train_step(reduce=False)  # builds the optimizer's slots before the state records them

    def rescale_lr():
        optimizer.lr.assign(BASE_LR * hvd.size())  # the Keras 2 name, as Horovod's script uses

    def make_state(**counters):
        return hvd.elastic.TensorFlowKerasState(model, optimizer, **counters)

hostname = os.environ["HOROVOD_HOSTNAME"]
start_rank = int(os.environ["HOROVOD_RANK"])
schedule = json.loads(args.discovery_schedule)
hosts_at = {epoch: hosts for epoch, hosts in schedule if epoch is not None}
later_hosts = schedule[-1][1] if schedule else []
exits = json.loads(args.exit_schedule)


def maybe_fail(epoch: int, batch: int) -> None:
    if start_rank not in exits.get(str((epoch, batch)), []):
        return
    if args.exit_mode == "kill":
        psutil.Process().kill()
    raise RuntimeError(f"scheduled failure at epoch {epoch} batch {batch} of start rank {start_rank}")


def wait_for_host_notice(state) -> None:
    """Rank 0, when the schedule changes the hosts after this epoch: the driver's notice must arrive."""
    state._last_updated_timestamp = 0
    deadline = time.monotonic() + args.discovery_wait
    while state._host_messages.empty():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no notice of the host change within {args.discovery_wait:g} s")
        time.sleep(0.1)


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    while state.epoch < args.epochs:
        while state.batch < args.batches_per_epoch:
            maybe_fail(state.epoch, state.batch)
            train_step()
            state.batch += 1
            state.commits += 1
            state.commit()
        if hvd.rank() == 0:
            with open(args.logfile, "a") as log:
                log.write(json.dumps({"epoch": state.epoch, "batch": state.batch, "commits": state.commits,
                                      "hostname": hostname, "start_rank": start_rank, "rank": hvd.rank(),
                                      "size": hvd.size(), "rendezvous": state.rendezvous}) + "\n")
            if hosts_at.get(state.epoch, later_hosts) != hosts_at.get(state.epoch + 1, later_hosts):
                wait_for_host_notice(state)
        time.sleep(args.epoch_wait)
        state.epoch += 1
        state.batch = 0
        state.commits += 1
        state.commit()


state = make_state(epoch=0, batch=0, commits=0, rendezvous=0)
state.register_reset_callbacks([rescale_lr])
train(state)
