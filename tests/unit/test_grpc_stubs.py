"""The committed gRPC stubs match proto/kite.proto, and the proto has the API the gateway and docs promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor as F

from kite_shared.grpc_gen import kite_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "kite.proto"
GENERATE = ROOT / "proto" / "generate.sh"
COMMITTED = ROOT / "shared" / "kite_shared" / "grpc_gen"
STUB_FILES = ("__init__.py", "kite_pb2.py", "kite_pb2_grpc.py", "kite_pb2.pyi")


def _generate(out: Path) -> None:
    result = subprocess.run(["bash", str(GENERATE), str(out)], env={**os.environ, "PYTHON": sys.executable},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"proto/generate.sh failed:\n{result.stdout}\n{result.stderr}"


def test_committed_stubs_are_up_to_date(tmp_path: Path) -> None:
    _generate(tmp_path)
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert generated == sorted(STUB_FILES)
    committed = sorted(p.name for p in COMMITTED.iterdir() if p.name != "__pycache__")
    assert committed == sorted(STUB_FILES), "shared/kite_shared/grpc_gen holds files generate.sh does not make"
    stale = [name for name in STUB_FILES if (tmp_path / name).read_bytes() != (COMMITTED / name).read_bytes()]
    assert not stale, f"stale gRPC stubs {stale}: run proto/generate.sh and commit the result"


def test_generated_grpc_module_imports_its_sibling_relatively() -> None:
    source = (COMMITTED / "kite_pb2_grpc.py").read_text()
    assert "from . import kite_pb2 as kite__pb2" in source
    assert "\nimport kite_pb2" not in source


def _field(message: type, name: str):
    fields = message.DESCRIPTOR.fields_by_name
    assert name in fields, f"{message.DESCRIPTOR.full_name} has no field {name!r}"
    return fields[name]


def _oneof(message: type, oneof: str) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.oneofs_by_name[oneof].fields}


def test_package_and_service_methods() -> None:
    assert kite_pb2.DESCRIPTOR.package == "kite.v1"
    service = kite_pb2.DESCRIPTOR.services_by_name["Kite"]
    generate = service.methods_by_name["Generate"]
    assert (generate.client_streaming, generate.server_streaming) == (False, True)
    assert generate.input_type.full_name == "kite.v1.GenerateRequest"
    assert generate.output_type.full_name == "kite.v1.GenerateResponse"
    health = service.methods_by_name["Health"]
    assert (health.client_streaming, health.server_streaming) == (False, False)
    assert health.input_type.full_name == "kite.v1.HealthRequest"
    assert health.output_type.full_name == "kite.v1.HealthResponse"


@pytest.mark.parametrize("name, type_, presence", [
    ("model", F.TYPE_STRING, False),
    ("max_tokens", F.TYPE_UINT32, True),
    ("temperature", F.TYPE_DOUBLE, True),
    ("top_p", F.TYPE_DOUBLE, True),
    ("seed", F.TYPE_INT64, True),
    ("disable_reuse", F.TYPE_BOOL, False),
    ("cache_salt", F.TYPE_STRING, False),
])
def test_generate_request_scalars(name: str, type_: int, presence: bool) -> None:
    field = _field(kite_pb2.GenerateRequest, name)
    assert field.type == type_
    assert not field.is_repeated
    # Presence is what lets "unset" mean the OpenAI default rather than 0.
    assert field.has_presence == presence


def test_generate_request_input_and_stop() -> None:
    assert _oneof(kite_pb2.GenerateRequest, "input") == {"messages", "prompt", "prompt_token_ids"}
    assert _field(kite_pb2.GenerateRequest, "messages").message_type.full_name == "kite.v1.ChatMessages"
    assert _field(kite_pb2.GenerateRequest, "prompt").type == F.TYPE_STRING
    assert _field(kite_pb2.GenerateRequest, "prompt_token_ids").message_type.full_name == "kite.v1.TokenIds"
    turns = _field(kite_pb2.ChatMessages, "messages")
    assert turns.is_repeated and turns.message_type.full_name == "kite.v1.Message"
    assert {f.name for f in kite_pb2.Message.DESCRIPTOR.fields} == {"role", "content"}
    ids = _field(kite_pb2.TokenIds, "ids")
    assert ids.is_repeated and ids.type == F.TYPE_UINT32
    stop = _field(kite_pb2.GenerateRequest, "stop")
    assert stop.is_repeated and stop.type == F.TYPE_STRING


def test_unset_temperature_defaults_are_distinguishable() -> None:
    request = kite_pb2.GenerateRequest(model="m", prompt="hi")
    assert not request.HasField("temperature") and not request.HasField("max_tokens")
    request.temperature = 0.0
    assert request.HasField("temperature")


def test_generate_response_events() -> None:
    assert _oneof(kite_pb2.GenerateResponse, "event") == {"chunk", "end"}
    assert _field(kite_pb2.Chunk, "text").type == F.TYPE_STRING
    token_ids = _field(kite_pb2.Chunk, "token_ids")
    assert token_ids.is_repeated and token_ids.type == F.TYPE_UINT32
    assert _field(kite_pb2.End, "finish_reason").type == F.TYPE_STRING
    assert _field(kite_pb2.End, "usage").message_type.full_name == "kite.v1.Usage"
    assert {f.name for f in kite_pb2.Usage.DESCRIPTOR.fields} == {
        "prompt_tokens", "completion_tokens", "cached_tokens"}


def test_health_response() -> None:
    status = _field(kite_pb2.HealthResponse, "status")
    assert status.enum_type.full_name == "kite.v1.HealthResponse.Status"
    assert {"SERVING", "NOT_SERVING"} <= set(status.enum_type.values_by_name)
    # proto3's zero value is what an unset field reads as: it must not claim SERVING.
    assert status.enum_type.values_by_number[0].name not in ("SERVING", "NOT_SERVING")
    assert _field(kite_pb2.HealthResponse, "live_workers").type == F.TYPE_UINT32


def test_every_declaration_is_documented(tmp_path: Path) -> None:
    """Every message, field, enum value and method of the API carries a comment in proto/kite.proto."""
    out = tmp_path / "kite.pb"
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO.parent}", "--include_source_info",
         f"--descriptor_set_out={out}", str(PROTO)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    file = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    commented = {tuple(loc.path) for loc in file.source_code_info.location
                 if loc.leading_comments.strip() or loc.trailing_comments.strip()}
    # Field numbers of FileDescriptorProto / DescriptorProto / ... in descriptor.proto, which source
    # locations use as path steps.
    undocumented = []

    def check_message(path: tuple[int, ...], message: descriptor_pb2.DescriptorProto, name: str) -> None:
        for i, field in enumerate(message.field):
            if path + (2, i) not in commented:
                undocumented.append(f"{name}.{field.name}")
        for i, enum in enumerate(message.enum_type):
            check_enum(path + (4, i), enum, f"{name}.{enum.name}")
        for i, nested in enumerate(message.nested_type):
            check_message(path + (3, i), nested, f"{name}.{nested.name}")

    def check_enum(path: tuple[int, ...], enum: descriptor_pb2.EnumDescriptorProto, name: str) -> None:
        for i, value in enumerate(enum.value):
            if path + (2, i) not in commented:
                undocumented.append(f"{name}.{value.name}")

    for i, message in enumerate(file.message_type):
        if (4, i) not in commented:
            undocumented.append(message.name)
        check_message((4, i), message, message.name)
    for i, service in enumerate(file.service):
        if (6, i) not in commented:
            undocumented.append(service.name)
        for j, method in enumerate(service.method):
            if (6, i, 2, j) not in commented:
                undocumented.append(f"{service.name}.{method.name}")
    assert not undocumented, f"undocumented in proto/kite.proto: {undocumented}"
