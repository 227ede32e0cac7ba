"""apps/server/tinker/wire.py and the Tinker datum -> batch conversion, with the SDK's own encoders and decoders."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from apps.http.errors import ServiceError
from apps.server.tinker.batches import tinker_batch
from apps.server.tinker.wire import WireSequence, decode_forward_backward, encode_forward_backward_output, \
    encode_sample_response


def _request(data, loss="ppo", config=None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
        model_id="ts-1:train:0", seq_id=3)
    return forward_backward_request_to_proto(request).SerializeToString()


def _datum(tokens, **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def test_the_sdks_forward_backward_body_decodes_plain_and_zstd():
    data = [_datum([5, 6, 7], target_tokens=[6, 7, 8], logprobs=[0.0, -1.0, -2.0], advantages=[0.0, 1.0, 1.0])]
    body = _request(data, config={"clip_low_threshold": 0.9})
    for payload, encoding in ((body, None), (zstandard.ZstdCompressor().compress(body), "zstd")):
        wire = decode_forward_backward(payload, encoding)
        assert (wire.model_id, wire.seq_id, wire.loss_fn, wire.forward_only) == ("ts-1:train:0", 3, "ppo", False)
        assert wire.loss_fn_config == {"clip_low_threshold": pytest.approx(0.9)}
        assert wire.data[0].tokens == [5, 6, 7]
        assert wire.data[0].inputs["advantages"].tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(ServiceError, match="does not decompress"):
        decode_forward_backward(b"not zstd", "zstd")
    with pytest.raises(ServiceError, match="not a tinker ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff", None)


def test_a_tinker_datum_becomes_n_plus_one_tokens_and_misalignment_names_the_field():
    wire = decode_forward_backward(_request([_datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[0.0, 1.0, 1.0]),
                                             _datum([9, 10], target_tokens=[10, 11])], loss="cross_entropy"), None)
    batch = tinker_batch(wire.data, "cross_entropy", pad_id=0, vocab_size=100, max_len=32)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert batch.response_mask.tolist() == [[0, 1, 1], [1, 1, 0]]  # weights; padding 0 (default 1 on real targets)
    bad = decode_forward_backward(_request([_datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[1.0, 1.0])],
                                           loss="cross_entropy"), None)
    with pytest.raises(ServiceError, match=r"data\[0\]\.loss_fn_inputs\['weights'\]: shape \[2\]; must be \[3\]"):
        tinker_batch(bad.data, "cross_entropy", pad_id=0, vocab_size=100, max_len=32)
    shifted = decode_forward_backward(_request([_datum([5, 6, 7], target_tokens=[6, 9, 8])], loss="cross_entropy"),
                                      None)
    with pytest.raises(ServiceError, match=r"\['target_tokens'\]\[1\]=9: must be model_input token 2"):
        tinker_batch(shifted.data, "cross_entropy", pad_id=0, vocab_size=100, max_len=32)
    missing = decode_forward_backward(_request([_datum([5, 6], target_tokens=[6, 7])], loss="ppo"), None)
    with pytest.raises(ServiceError, match=r"\['logprobs'\]: missing; loss 'ppo' needs"):
        tinker_batch(missing.data, "ppo", pad_id=0, vocab_size=100, max_len=32)


def test_results_decode_with_the_sdks_own_decoders():
    outputs = [{"logprobs": np.array([-1.0, -2.0], np.float32)}, {"logprobs": np.array([-3.0], np.float32)}]
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {"loss:sum": 6.0}))
    assert [o["logprobs"].to_numpy().tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    assert decoded.metrics == {"loss:sum": 6.0}
    sample = deserialize_sample_response(encode_sample_response(
        [WireSequence([4, 5], [-0.5, -0.25], True), WireSequence([6], [-1.0], False)], [None, -2.0]))
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.sequences[0].tokens == [4, 5] and sample.prompt_logprobs[0] is None
    assert sample.prompt_logprobs[1] == pytest.approx(-2.0)
