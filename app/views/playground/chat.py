"""The Playground's conversation engine: models and adapters kept loaded, and a QThread that
answers the latest user turn with the base model and with the adapter, token by token in turn.

Each side keeps its own history (the same user turns, its own answers); a turn is rendered with
the model's chat template (`generation_prompt_ids`, the system prompt first) or, without the
template, the last message is continued as plain text.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QThread, Signal

from app.engine.api import (ConfigError, generation_prompt_ids, load_adapter, load_model,
                            source_from_run)

SIDES = ("base", "adapter")
SPEAKERS = {"user": "You", "assistant": "Model", "system": "System"}


def transcript(history: list[dict], partial: str | None = None) -> str:
    """A conversation as text; `partial`: the answer being written."""
    turns = [f"{SPEAKERS.get(m['role'], m['role'])}: {m['content']}" for m in history]
    if partial is not None:
        turns.append(f"Model: {partial}")
    return "\n\n".join(turns)


class ModelCache:
    """Models and adapters loaded by the generation thread (one model at a time)."""

    def __init__(self):
        self.models: dict[str, object] = {}
        self.adapters: dict[tuple, object] = {}

    def model(self, path: str):
        if path not in self.models:
            self.models.clear()
            self.adapters.clear()
            self.models[path] = load_model(path)
        return self.models[path]

    def adapter(self, key: tuple, model):
        """key: ("file", path, mtime) or ("run", run_dir, checkpoint step)."""
        if key not in self.adapters:
            if key[0] == "file":
                adapter = load_adapter(key[1])
            else:
                adapter = source_from_run(key[1], step=key[2], model_path=model.path).adapter
                if adapter is None:
                    raise ConfigError("The run trained the model in full: it has no adapter.",
                                      "Export it as a merged model and open that instead.")
            self.adapters = {key: adapter}
        return self.adapters[key]


class Reply(QThread):
    """Answers the last user turn of each side's history; emits each side's answer as it
    grows. `answers` holds the finished answers."""

    text = Signal(str, str)          # side, the answer so far
    failed = Signal(object)
    loaded = Signal(str)             # a status line once the model and adapter are ready

    def __init__(self, cache: ModelCache, request: dict, parent=None):
        super().__init__(parent)
        self.cache, self.request = cache, request
        self._stop = False
        self.tokens = {side: 0 for side in request["histories"]}
        self.answers: dict[str, str] = {}
        self.elapsed = 0.0

    def stop(self) -> None:
        self._stop = True

    def stopped(self) -> bool:
        return self._stop

    def run(self) -> None:
        try:
            self._generate()
        except Exception as e:                  # noqa: BLE001 -- to the error funnel
            self.failed.emit(e)

    def _prompt_ids(self, tok, history: list[dict]) -> list[int]:
        r = self.request
        if not r["chat"]:
            return generation_prompt_ids(tok, history[-1]["content"])
        system = [{"role": "system", "content": r["system"]}] if r["system"].strip() else []
        return generation_prompt_ids(tok, system + history)

    def _generate(self) -> None:
        r = self.request
        model = self.cache.model(r["model"])
        adapter = self.cache.adapter(r["adapter_key"], model) if r["adapter_key"] else None
        tok = model.tokenizer
        stop = None if r["stop_eos"] else []           # None: the model's EOS/EOT tokens
        streams = {}
        for side, history in r["histories"].items():
            ids = self._prompt_ids(tok, history)
            on = adapter if side == "adapter" else None
            streams[side] = model.generate(ids, r["max_tokens"], r["temperature"], r["top_p"],
                                           r["seed"], on, r["scale"], stop)
        self.loaded.emit(f"{len(ids)} prompt tokens")
        out = {side: [] for side in streams}
        t0 = time.perf_counter()
        while streams and not self._stop:
            for side in list(streams):
                try:
                    token = next(streams[side])
                except StopIteration:
                    del streams[side]
                    continue
                out[side].append(token)
                self.tokens[side] += 1
                text = tok.decode(out[side])
                if not text.endswith("\ufffd"):        # a multi-byte character is complete
                    self.text.emit(side, text)
                if self._stop:
                    break
        self.answers = {side: tok.decode(ids_) for side, ids_ in out.items()}
        self.elapsed = time.perf_counter() - t0
