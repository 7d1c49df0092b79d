"""Every engine handle (EngineProcess, EngineThread, EndpointClient) is an EngineHandle
(protocol.handle): each member there, each method with the protocol's parameters."""

from __future__ import annotations

import inspect

import pytest

from fgchat.client.handle import EndpointClient
from fgchat.engine.process import EngineProcess, EngineThread
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.handle import EngineHandle

METHODS = [name for name, value in vars(EngineHandle).items()
           if inspect.isfunction(value) and not name.startswith("_")]


def _mismatches(cls: type) -> list[str]:
    """Methods of EngineHandle that `cls` lacks or takes other parameters (names, kinds,
    defaults) for."""
    out = []
    for name in METHODS:
        mine = getattr(cls, name, None)
        if mine is None or not callable(mine) or mine is getattr(EngineHandle, name):  # none, or the stub
            out.append(f"{name}: missing")
            continue
        want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(EngineHandle, name)).parameters.values()]
        got = [(p.name, p.kind, p.default) for p in inspect.signature(mine).parameters.values()]
        if got != want:
            out.append(f"{name}: {got} != {want}")
    return out


def _handles() -> list:
    config = EngineConfig(preset="tiny", device="cpu")
    return [EngineProcess(config), EngineThread(config), EndpointClient("http://127.0.0.1:9")]


def test_the_protocol_states_the_interface_callers_use():
    assert {"submit_chat", "submit_chats", "cancel", "set_mode", "request_info", "get_events", "start",
            "shutdown", "is_alive"} <= set(METHODS)


@pytest.mark.parametrize("handle", _handles(), ids=lambda h: type(h).__name__)
def test_every_handle_is_an_engine_handle(handle):
    assert isinstance(handle, EngineHandle)
    assert _mismatches(type(handle)) == []
    assert handle.failed is False and handle.started_at is None and handle.fit_context is False


def test_a_handle_that_lacks_a_method_or_takes_other_parameters_is_caught():
    class Partial(EngineThread):
        def cancel(self, rid: int, now: bool = True) -> None:  # other parameters
            pass

    found = _mismatches(Partial)
    assert len(found) == 1 and found[0].startswith("cancel: [('self'") and "'now'" in found[0], found

    class Stubbed(EngineHandle):  # inherits the protocol's bodies, implements nothing
        pass

    assert len(_mismatches(Stubbed)) == len(METHODS)

    class Bare:
        fit_context = False
        started_at = None
        pid = None

    assert not isinstance(Bare(), EngineHandle)
    assert "cancel: missing" in _mismatches(Bare)


def test_an_endpoint_refuses_a_raw_prompt_in_one_line():
    from fgchat.protocol.errors import FgchatError

    with pytest.raises(FgchatError, match="raw prompt"):
        EndpointClient("http://127.0.0.1:9").submit_chats("text", [])


def test_an_endpoint_refuses_speculation_in_one_line():
    from fgchat.protocol.errors import FgchatError

    with pytest.raises(FgchatError, match="speculation runs in the local engine") as exc:
        EndpointClient("http://127.0.0.1:9").set_speculation("ngram", 4)
    assert "\n" not in str(exc.value)
