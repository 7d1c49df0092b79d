"""Speculative decoding in the engine: a mixin of `Engine` (engine.core) holding the method, the
draft length and the proposers, and running a speculative step where one pays."""

from __future__ import annotations

from typing import Any

from fgchat.engine.speculate import check_draft_len, check_method


class SpecLoop:
    """The engine's speculation state and its live switch."""

    config: Any

    def _init_speculation(self) -> None:
        self.spec_method = "off"
        self.spec_draft_len = check_draft_len(self.config.draft_len)
        self.spec_draft_name = ""
        if self.config.draft is not None and self.config.speculate != "draft":
            from fgchat.protocol.errors import FgchatError

            raise FgchatError("--draft needs --speculate draft")
        self.set_speculation(self.config.speculate)

    def set_speculation(self, method: str, draft_len: int | None = None) -> None:
        """Switch speculation for the next decode steps; `draft_len` None keeps the current one."""
        check_method(method)
        if draft_len is not None:
            self.spec_draft_len = check_draft_len(draft_len)
        self.spec_method = method
