"""The public surface is deliberate: __all__ lists what the packages export, nothing else."""

import importlib
import pkgutil
import subprocess
import sys

import protocol

EXPECTED_PROTOCOL = {
    "CODECS",
    "ApplyResult",
    "CheckpointError",
    "ClientError",
    "Codec",
    "CodecError",
    "CommitConflict",
    "Compacted",
    "CompleteTime",
    "Conflict",
    "Consumer",
    "CountMismatch",
    "Decoder",
    "Encoder",
    "FeedChecker",
    "FeedClient",
    "Gap",
    "MemoryStore",
    "Message",
    "Progress",
    "ProtocolError",
    "SourceError",
    "StaleEpoch",
    "Store",
    "StoreState",
    "TidefeedError",
    "Update",
    "Updates",
    "Violation",
    "announcement",
    "arrow_to_avro",
    "avro_to_arrow",
    "cdcv2_schema",
    "check_messages",
    "codec_for_content_type",
    "consolidate",
    "fingerprint",
    "get_codec",
    "progress",
    "record_key",
}


def test_protocol_exports_exactly_the_curated_api():
    assert set(protocol.__all__) == EXPECTED_PROTOCOL
    assert set(protocol._WHERE) == EXPECTED_PROTOCOL  # (the names it loads on first use)
    for name in protocol.__all__:
        assert getattr(protocol, name) is not None


def test_each_public_name_is_its_definition_whatever_was_imported_before():
    """A package attribute named like a submodule is replaced by that submodule when it is
    imported (``from protocol import consolidate`` gave the module once ``protocol.state``
    had loaded it): in a fresh interpreter, every submodule first, then every name."""
    script = (
        "import importlib, pkgutil, types, protocol\n"
        "for info in pkgutil.walk_packages(protocol.__path__, 'protocol.'):\n"
        "    importlib.import_module(info.name)\n"
        "for name in protocol.__all__:\n"
        "    home = importlib.import_module('protocol.' + protocol._WHERE[name])\n"
        "    got = getattr(protocol, name)\n"
        "    assert got is getattr(home, name), (name, got)\n"
        "    assert not isinstance(got, types.ModuleType), name\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-2000:]


def test_every_module_declares_all():
    import feed

    for pkg in (protocol, feed):
        for info in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
            module = importlib.import_module(info.name)
            assert hasattr(module, "__all__"), f"{module.__name__} lacks __all__"
            for name in module.__all__:
                assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name}"
