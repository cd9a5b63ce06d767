"""The elastic driver's parts on their own: discovery output, the blacklist, ElasticSampler in one process."""

import pytest
import torch

import roundel.torch as hvd
from roundel.runner.discovery import Blacklist, DiscoveryError, HostDiscovery, parse_discovery_output


def test_discovery_output_parsing():
    text = "# hosts\nhost-a:4\n\nhost-b\n10.0.0.7:2\n"
    assert parse_discovery_output(text, 3) == {"host-a": 4, "host-b": 3, "10.0.0.7": 2}
    with pytest.raises(DiscoveryError, match="line 1 .*'host-a:x'"):
        parse_discovery_output("host-a:x\n", 1)
    with pytest.raises(DiscoveryError, match="host 'a' is listed twice"):
        parse_discovery_output("a:1\na:2\n", 1)


def test_failing_discovery_script_keeps_the_last_answer(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho good:2\n")
    script.chmod(0o755)
    discovery = HostDiscovery(str(script), 1)
    assert discovery.poll() == {"good": 2}
    script.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    assert discovery.poll() == {"good": 2}
    script.write_text("#!/bin/sh\necho 'bad line with spaces'\n")
    assert discovery.poll() == {"good": 2}


def test_blacklist_forever_and_with_cooldown():
    now = [100.0]
    forever = Blacklist(clock=lambda: now[0])
    assert forever.add("a") == float("inf")
    now[0] += 1e6
    assert forever.contains("a") and not forever.contains("b")

    # Horovod's cooldown: LO * 2**k plus a random fraction of LO after the k-th listing, within [LO, HI]
    fraction = [0.5]
    cooling = Blacklist((1.0, 10.0), clock=lambda: now[0], uniform=lambda a, b: fraction[0])
    assert cooling.add("a") == 2.5  # 1 * 2 + 0.5
    assert cooling.contains("a")
    now[0] += 1.0
    assert cooling.add("a") == 1.5, "a failure while cooling down neither counts nor extends"
    now[0] += 1.5
    assert not cooling.contains("a"), "the host is re-admitted after its cooldown"
    fraction[0] = 0.25
    assert cooling.add("a") == 4.25  # second listing: 1 * 4 + 0.25
    now[0] += 5
    assert cooling.add("a") == 8.25
    now[0] += 9
    assert cooling.add("a") == 10.0, "capped at HI"
    assert Blacklist.cooldown(3.0, 5.0, 1, 0.0) == 5.0 and Blacklist.cooldown(3.0, 3.0, 1, 0.9) == 3.0
    assert Blacklist.cooldown(0.5, 0.5, 1, 0.0) == 0.5, "never below LO"
    real = Blacklist((2.0, 4.0), clock=lambda: now[0])
    assert 4.0 >= real.add("b") >= 4.0  # 2 * 2 + up to 2, capped at 4


@pytest.fixture
def single_process_job():
    hvd.init()
    yield
    hvd.shutdown()


def test_elastic_sampler_remembers_progress_in_an_epoch(single_process_job):
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
    order = list(sampler)
    assert sorted(order) == list(range(10)) and len(sampler) == 10
    sampler.record_batch(0, 3)
    assert sampler.processed_indices == set(order[:3])
    saved = sampler.state_dict()
    sampler.set_epoch(0)  # the current epoch again, as a resumed loop calls it: progress kept
    assert list(sampler) == order[3:]
    sampler.record_batch(0, 3)  # batch 0 of the re-sharded rest
    assert sampler.processed_indices == set(order[:6])
    sampler.load_state_dict(saved)  # back to the commit
    assert list(sampler) == order[3:]
    sampler.set_epoch(1)  # a new epoch: all samples again, in another order
    assert sorted(sampler) == list(range(10)) and list(sampler) != order
    sampler.record_indices([4, 2])
    assert sorted(sampler.state_dict()["processed_indices"]) == [2, 4]


def test_torch_state_sync_makes_what_was_received_the_rollback_point(single_process_job):
    # a rank that just joined has no commit of its own: after sync() a failure must bring it back
    # to what it received (one rank here, so what it "receives" is its own current state)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(torch.utils.data.TensorDataset(torch.arange(8)), shuffle=False)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, step=3)
    with torch.no_grad():
        model.weight.fill_(0.5)
    sampler.record_batch(0, 2)
    state.sync()
    with torch.no_grad():
        model.weight.fill_(0.9)
    sampler.record_batch(1, 2)
    state.step = 4
    state.restore()
    assert model.weight.tolist() == [[0.5, 0.5]]
    assert sampler.processed_indices == {0, 1}
    assert state.step == 3

