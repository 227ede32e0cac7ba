"""The Tinker protocol's binary bodies: forward / forward_backward requests in (protobuf, optionally zstd), and the
forward_backward and sample results out (protobuf). The schema is the Tinker SDK's own generated message module
(`tinker.proto.tinker_public_pb2`, a dependency of the server), so the server reads and writes exactly what the
pinned SDK writes and reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from apps.http.errors import ServiceError

PROTOBUF = "application/x-protobuf"
MAX_DECOMPRESSED_BYTES = 1 << 30  # a zstd body may not expand past this (a small body must not fill the memory)

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class WireDatum:
    tokens: list[int]  # the model input's tokens, its chunks concatenated
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # loss_fn_inputs by name, dense


@dataclass
class WireForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]


def _user_error(message: str) -> ServiceError:
    return ServiceError(400, message)


def decode_forward_backward(body: bytes, content_encoding: str | None) -> WireForwardBackward:
    """A ForwardBackwardRequest as the SDK sends it; a 400 naming what is wrong otherwise."""
    if content_encoding and content_encoding.lower() == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_DECOMPRESSED_BYTES)
        except zstandard.ZstdError as error:
            raise _user_error(f"Content-Encoding: zstd, but the body does not decompress: {error}") from None
    elif content_encoding and content_encoding.lower() != "identity":
        raise _user_error(f"Content-Encoding: {content_encoding!r}: only zstd or none is accepted")
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError
        raise _user_error(f"the body is not a tinker ForwardBackwardRequest message: {error}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():  # v2 wins where both are set (the SDK writes both)
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = [_datum(d, i) for i, d in enumerate(message.data)]
    return WireForwardBackward(model_id=message.model_id, seq_id=int(message.seq_id), loss_fn=message.loss_fn,
                               loss_fn_config=config, forward_only=bool(message.forward_only), data=data)


def _datum(message: pb.Datum, index: int) -> WireDatum:
    tokens: list[int] = []
    for chunk in message.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise _user_error(f"data[{index}].model_input: a {kind} chunk; this server's model takes text tokens only")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {name: _tensor(tensor, f"data[{index}].loss_fn_inputs[{name!r}]")
              for name, tensor in message.loss_fn_inputs.items()}
    return WireDatum(tokens, inputs)


def _tensor(message: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NUMPY.get(message.dtype)
    if dtype is None:
        raise _user_error(f"{where}: dtype {pb.DType.Name(message.dtype)} is not accepted (float32, int64, int32)")
    shape = list(message.shape)
    if message.WhichOneof("encoding") == "sparse_csr":
        csr = message.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        rows = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        dense_shape = shape if len(shape) == 2 else [1, shape[0] if shape else int(cols.max(initial=-1)) + 1]
        out = np.zeros(dense_shape, dtype=dtype)
        for r in range(len(rows) - 1):
            out[r, cols[rows[r]:rows[r + 1]]] = values[rows[r]:rows[r + 1]]
        return out.reshape(shape) if shape else out.reshape(-1)
    values = np.frombuffer(message.dense, dtype=dtype).copy()
    if shape and int(np.prod(shape)) != values.size:
        raise _user_error(f"{where}: shape {shape} does not hold its {values.size} values")
    return values.reshape(shape) if shape else values


def _batched(rows: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    """Per-datum 1-D arrays as one BatchedTensor: the bytes back to back, offsets in bytes."""
    numpy_dtype = _NUMPY[dtype]
    arrays = [np.ascontiguousarray(r, dtype=numpy_dtype) for r in rows]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=dtype)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord of float32 fields (logprobs, elementwise_loss) per datum."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else []:
        record.fields[name].CopyFrom(_batched([o[name] for o in outputs], pb.DTYPE_FLOAT32))
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    if outputs:
        message.loss_fn_outputs.append(record)
    return message.SerializeToString()


@dataclass
class WireSequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # True: a stop token or string ended it; False: max_tokens did


def encode_sample_response(sequences: list[WireSequence], prompt_logprobs: list[float | None] | None) -> bytes:
    message = pb.SampleResponse()
    for seq in sequences:
        message.sequences.append(pb.SampledSequence(
            stop_reason=pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes()))
    if prompt_logprobs is not None:  # NaN where a position has none (the first prompt token)
        values = [np.nan if v is None else v for v in prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return message.SerializeToString()
