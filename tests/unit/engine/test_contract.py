"""The engine's gRPC contract can be used without torch (the gateway imports it)."""

from __future__ import annotations

import subprocess
import sys


def test_generated_stubs_import_no_torch() -> None:
    code = (
        "import sys\n"
        "from engine import engine_pb2, engine_pb2_grpc\n"
        "assert engine_pb2.GenerateRequest(prompt='x').prompt == 'x'\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stubs_match_the_proto() -> None:
    from engine import engine_pb2

    names = {m.name for m in engine_pb2.DESCRIPTOR.services_by_name["Engine"].methods}
    assert names == {
        "Generate",
        "Abort",
        "LoadAdapter",
        "UnloadAdapter",
        "ListAdapters",
        "Stats",
        "Tokenize",
        "Detokenize",
    }
