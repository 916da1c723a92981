"""Envoy's external-processing messages as the endpoint picker speaks them (the Gateway API
Inference Extension's endpoint-picker protocol, docs/kubernetes.md has the citations).

Only message building and reading lives here, no routing: the picked endpoint goes out twice
with the same value, as the request header ``x-gateway-destination-endpoint`` and in the
dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint`` (the protocol requires
both and that they agree); errors are an ``ImmediateResponse`` with an OpenAI JSON body; in
``FULL_DUPLEX_STREAMED`` mode the picker returns every body byte it was given as
``streamed_response`` chunks (Envoy forwards only what the processor sends back).

Needs ``grpcio`` and ``xds-protos`` (the ``epp`` extra); nothing outside the picker imports
this module.
"""

from __future__ import annotations

from collections.abc import Iterator

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# a streamed body chunk back to Envoy: at most this many bytes (the reference picker's limit,
# under the 64 KiB some Envoy builds accept per chunk)
CHUNK_BYTES = 62_000

Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
BUFFERED = Mode.BUFFERED


def headers_of(h: pb.HttpHeaders) -> dict[str, str]:
    """The header map (keys lower case; Envoy sends ``raw_value`` bytes, older ones
    ``value``); a repeated header keeps its first value."""
    out: dict[str, str] = {}
    for hv in h.headers.headers:
        key = hv.key.lower()
        if key not in out:
            out[key] = hv.raw_value.decode("latin-1") if hv.raw_value else hv.value
    return out


def _field(meta: base_pb2.Metadata, namespace: str, key: str) -> struct_pb2.Value | None:
    ns = meta.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    return ns.fields[key]


def subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the data plane allows (``envoy.lb.subset_hint`` /
    ``x-gateway-destination-endpoint-subset``), None when it sets no subset."""
    if not req.HasField("metadata_context"):
        return None
    v = _field(req.metadata_context, SUBSET_NAMESPACE, SUBSET)
    if v is None:
        return None
    if v.HasField("list_value"):
        return [x.string_value for x in v.list_value.values if x.string_value]
    return [e.strip() for e in v.string_value.split(",") if e.strip()]


def served_endpoint(req: pb.ProcessingRequest,
                    headers: dict[str, str] | None = None) -> str | None:
    """The endpoint that served the response, when the data plane reports it: the
    ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` metadata, or the response header
    of that name (``headers``; e.g. Envoy's ``%UPSTREAM_HOST%``, docs/envoy)."""
    if req.HasField("metadata_context"):
        v = _field(req.metadata_context, LB_NAMESPACE, SERVED)
        if v is not None and v.string_value:
            return v.string_value
    found = (headers or {}).get(SERVED)
    return found.strip() if found else None


def _set(headers: list[tuple[str, str]]) -> pb.HeaderMutation:
    return pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
        for k, v in headers])


def _destination_metadata(endpoint: str) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = endpoint
    return meta


def destination(endpoint: str, *, body_length: int | None = None,
                in_body_response: bool = False, body: bytes | None = None,
                ) -> pb.ProcessingResponse:
    """The picked endpoint: header mutation (plus ``content-length`` when the body was
    rewritten) with the route cache cleared, and the ``envoy.lb`` dynamic metadata. As the
    answer to the request headers, or (``in_body_response``: buffered mode, where the headers
    are still held) to the request body, with ``body`` replacing it when given."""
    headers = [(DESTINATION, endpoint)]
    if body_length is not None:
        headers.append(("content-length", str(body_length)))
    common = pb.CommonResponse(header_mutation=_set(headers), clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
    if in_body_response:
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                     dynamic_metadata=_destination_metadata(endpoint))
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                 dynamic_metadata=_destination_metadata(endpoint))


def streamed_body(body: bytes, *, end: bool, request: bool) -> Iterator[pb.ProcessingResponse]:
    """``body`` sent back in full-duplex mode, in chunks of at most :data:`CHUNK_BYTES`;
    ``end`` marks the last one's end of stream (one empty chunk for an empty body)."""
    n = len(body)
    starts = range(0, n, CHUNK_BYTES) if n else (0,)
    for i in starts:
        piece = body[i:i + CHUNK_BYTES]
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=piece,
                                                      end_of_stream=end and i + CHUNK_BYTES >= n)))
        yield (pb.ProcessingResponse(request_body=pb.BodyResponse(response=common)) if request
               else pb.ProcessingResponse(response_body=pb.BodyResponse(response=common)))


def request_headers_continue() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def request_body_continue() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_body=pb.BodyResponse())


def request_trailers_continue() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def response_headers(headers: list[tuple[str, str]]) -> pb.ProcessingResponse:
    """The response headers let through, with ``headers`` added (which instance answered)."""
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=_set(headers))))


def response_body_continue() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_body=pb.BodyResponse())


def response_trailers_continue() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate(status: int, body: bytes, *, details: str,
              headers: list[tuple[str, str]] | None = None) -> pb.ProcessingResponse:
    """Answer the client now (Envoy sends no request upstream): ``status`` with a JSON body."""
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # (StatusCode's values are the codes)
        headers=_set([("content-type", "application/json"), *(headers or [])]),
        body=body, details=details))
