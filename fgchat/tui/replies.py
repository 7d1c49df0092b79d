"""Reply bookkeeping: the engine requests a chat has in flight (`FgchatApp.replies`, keyed by
request id) from submission to their stored end.

Invariants:
- A reply is stored exactly once, when it finishes, stops, fails or the app exits, and is
  removed from `replies` at that moment; storing happens before any UI update.
- Request ids are allocated here, unique for the app's lifetime (also across engine restarts),
  so log rows never mix two requests.
- Extra samples (K > 1) are stored with meta "alt" and never fed back as conversation turns.
- The K replies of one prompt go to the engine as one command (`submit_chats`), after all K
  bubbles exist: the engine admits and prefills them in one round, so they decode at batch K
  from their first step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fgchat.protocol.events import RequestSummary, SamplingParams
from fgchat.tui.chat_view import ChatView, MessageBubble, reply_status
from fgchat.tui.store import Conversation, StoredMessage

MAX_SAMPLES = 8  # the engine batches at most 8 sequences
K_TEMPERATURE = 0.7  # temperature of K > 1 replies when the user's is 0 (greedy)


def reply_params(base: SamplingParams, k: int) -> tuple[list[SamplingParams], str]:
    """The sampling parameters of the K replies asked for together, and a note ("" when none).

    Reply j (0-based) uses seed `base.seed + j`, so the K replies differ from each other and
    every run of the same prompt and settings gives the same K. K = 1 keeps the user's settings
    as they are. K > 1 with temperature 0 (greedy) would give K identical copies, so the K
    replies are sampled at K_TEMPERATURE (0.7) instead, with the user's top-p, top-k and seeds;
    the note says so.
    """
    k = max(1, int(k))
    if k == 1:
        return [base], ""
    note = ""
    if base.temperature == 0:
        base = replace(base, temperature=K_TEMPERATURE)
        note = f"K={k}: sampled at T {K_TEMPERATURE:g} (greedy gives K copies)"
    return [replace(base, seed=base.seed + j) for j in range(k)], note


@dataclass
class Reply:
    """A reply being generated: one engine request."""

    rid: int
    conversation: Conversation
    bubble: MessageBubble
    sample: int  # 1-based index among the K replies asked for together
    of: int
    tokens: int = 0
    stopping: bool = False

    @property
    def primary(self) -> bool:
        return self.sample == 1


class ReplyMixin:
    """FgchatApp's reply lifecycle (`self.replies`, `self._next_rid`, `self._rid_chat`)."""

    async def _start_replies(self, chat: ChatView) -> None:
        conv = chat.conversation
        messages = conv.prompt_messages()
        k = self.samples
        params, _note = reply_params(self.sampling, k)
        requests = []
        # every bubble first, then one command: the engine gets the K requests at once
        for j in range(1, k + 1):
            rid = self._next_rid
            self._next_rid += 1
            label = f"assistant {j}/{k}" if k > 1 else "assistant"
            bubble = await chat.add_reply(label)
            self.replies[rid] = Reply(rid, conv, bubble, j, k)
            self._rid_chat[rid] = conv.id
            requests.append((rid, params[j - 1]))
        submit_chats = getattr(self.engine, "submit_chats", None)
        if submit_chats is not None:
            submit_chats(messages, requests)
        else:  # an engine handle without the batched command: one submit per reply
            for rid, p in requests:
                self.engine.submit_chat(rid, messages, p)
        self._update_tab(conv)
        self._dirty = True

    async def _finish_reply(self, summary: RequestSummary) -> None:
        reply = self.replies.pop(summary.request_id, None)
        if reply is None:
            return
        # store first (synchronously): nothing is lost if the UI update below is interrupted;
        # the timing goes with it, so a reopened chat shows the same stats line
        meta = {"finish": summary.finish_reason, "tokens": summary.output_tokens,
                "ttft_ms": round(summary.ttft_ms, 3),
                "tpot_ms": None if summary.tpot_ms is None else round(summary.tpot_ms, 3)}
        self._persist_reply(reply, summary.text, meta)
        self._update_tab(reply.conversation)
        await reply.bubble.finish(reply_status(meta), final_text=summary.text)

    async def _fail_reply(self, rid: int, message: str) -> None:
        reply = self.replies.pop(rid, None)
        if reply is None:
            return
        self._persist_reply(reply, reply.bubble.text,
                            {"finish": "error", "error": message, "tokens": reply.tokens})
        self._update_tab(reply.conversation)
        await reply.bubble.finish(f"error: {message} · partial reply kept ({reply.tokens} tok)")

    def _persist_reply(self, reply: Reply, text: str, meta: dict) -> None:
        meta = {**meta, "rid": reply.rid}
        if reply.of > 1:
            meta.update(sample=reply.sample, of=reply.of)
        if not reply.primary:
            meta["alt"] = True  # extra samples are kept but not fed back as conversation turns
        msg = StoredMessage("assistant", text, meta)
        reply.conversation.messages.append(msg)
        reply.bubble.stored = msg  # type: ignore[attr-defined]
        self._store_message(reply.conversation, msg)

    def _store_message(self, conversation: Conversation, msg: StoredMessage) -> None:
        # sqlite errors: keep going (the message stays in memory), say so in one line
        self._store_call("save the message", self.store.add_message, conversation, msg)

    def action_stop(self) -> None:
        chat = self.current_chat
        if chat is None:
            return
        for reply in self.replies.values():
            if reply.conversation is chat.conversation and not reply.stopping:
                reply.stopping = True
                reply.bubble.set_status("stopping…")
                self.engine.cancel(reply.rid)

    async def action_regenerate(self) -> None:
        chat = self.current_chat
        if chat is None:
            return
        conv = chat.conversation
        if self.chat_busy(conv):
            self.notify("wait for the reply to finish (Esc stops it)", severity="warning")
            return
        if self.engine_state == "failed":
            self.notify(f"the engine is not running: {self.engine_error}", severity="error")
            return
        last_user = max((i for i, m in enumerate(conv.messages) if m.role == "user"), default=None)
        if last_user is None:
            self.notify("nothing to regenerate yet", severity="warning")
            return
        dropped = conv.messages[last_user + 1:]
        del conv.messages[last_user + 1:]
        ids = [m.id for m in dropped if m.id is not None]
        if ids:  # a failure leaves the old replies on disk; the new one is still generated
            self._store_call("delete the replaced replies from the store",
                             self.store.delete_messages, conv, ids)
        dropped_ids = {id(m) for m in dropped}
        for bubble in chat.bubbles():
            if id(getattr(bubble, "stored", None)) in dropped_ids:
                await bubble.remove()
        _params, note = reply_params(self.sampling, self.samples)
        if note:
            self.notify(f"regenerating: {note}", timeout=4)
        await self._start_replies(chat)
