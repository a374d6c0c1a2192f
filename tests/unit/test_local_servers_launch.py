"""kite_cli.local_servers' launch: a server that exits before listening is started once more, and the error
says what it printed."""

from __future__ import annotations

import pytest

from kite_cli.local_servers import ServerStartError, _launch, free_port


def test_a_server_that_exits_before_listening_is_tried_twice_and_its_output_is_in_the_error(tmp_path):
    script = tmp_path / "server.sh"
    script.write_text("#!/bin/sh\necho \"started, and gave up\"\nexit 3\n")
    script.chmod(0o755)
    log_file = tmp_path / "server.log"
    with pytest.raises(ServerStartError) as failed:
        _launch("nats-server", [str(script)], free_port(), tmp_path / "work", log_file)
    assert "exited with code 3 before listening" in str(failed.value)
    assert "started, and gave up" in str(failed.value)
    assert log_file.read_text().count("started, and gave up") == 2


def test_a_server_that_listens_on_the_second_try_is_returned(tmp_path):
    port = free_port()
    marker = tmp_path / "tried"
    script = tmp_path / "server.sh"
    # The first run exits at once; the second listens (python's http.server) until stopped.
    script.write_text(f"#!/bin/sh\nif [ ! -e {marker} ]; then touch {marker}; echo first; exit 1; fi\n"
                      f"exec python3 -m http.server {port} --bind 127.0.0.1\n")
    script.chmod(0o755)
    (tmp_path / "work").mkdir()
    server = _launch("nats-server", [str(script)], port, tmp_path / "work", None)
    try:
        assert server.process.poll() is None
        assert (tmp_path / "work" / "nats-server.log").read_text().startswith("first")
    finally:
        server.stop()
