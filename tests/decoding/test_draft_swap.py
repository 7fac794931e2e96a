"""A new draft can be handed to a serving proposer at any moment without changing the output."""

import threading
import time

import pytest

from onlinespec.decoding.autoregressive import autoregressive_decoder
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder

PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)


def test_swap_between_rounds_keeps_greedy_output(tiny_target, tiny_draft):
    class SwapsAtThirdRound(DraftModelProposer):
        calls = 0

        def propose(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 3:
                self.swap_model(tiny_target, "v1")  # the target itself: every proposal is accepted from now on
            return super().propose(*args, **kwargs)

    proposer = SwapsAtThirdRound(tiny_draft, version="v0")
    out = SpeculativeDecoder(tiny_target, None, proposer, k=3).generate([1, 2, 3], PARAMS)
    expected = autoregressive_decoder(tiny_target).generate([1, 2, 3], PARAMS)
    assert out.token_ids == expected.token_ids
    assert proposer.version == "v1" and proposer.model is tiny_target
    assert out.stats.acceptance_rate > 0.5  # the swapped-in draft was really used


@pytest.mark.parametrize("max_batch", [1, 3], ids=["one-at-a-time", "batched"])
def test_swaps_from_another_thread_never_break_a_request(tiny_target, tiny_draft, max_batch):
    proposer = DraftModelProposer(tiny_draft)
    decoder = SpeculativeDecoder(tiny_target, None, proposer, k=2)
    stop = threading.Event()
    versions_served = set()

    def swapper():
        i = 0
        while not stop.is_set():
            i += 1
            proposer.swap_model(tiny_target if i % 2 else tiny_draft, f"v{i}")
            versions_served.add(proposer.version)
            time.sleep(1e-4)  # thousands of swaps a second, without starving the serving thread of the GIL

    thread = threading.Thread(target=swapper)
    thread.start()
    try:
        outputs = [o.token_ids for o in decoder.generate_many([[3, 4, 5]] * 5, PARAMS, max_batch=max_batch)]
    finally:
        stop.set()
        thread.join()
    expected = autoregressive_decoder(tiny_target).generate([3, 4, 5], PARAMS).token_ids
    assert all(o == expected for o in outputs)
    assert len(versions_served) > 3  # the engine really took swaps while it served
