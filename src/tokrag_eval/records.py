"""The records file of an evaluation run: one JSON line per (item, condition, policy),
appended as soon as it is known, so an interrupted run continues where it stopped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["NO_PASSAGES", "RecordStore"]

#: Condition name of policies that ignore passages: decoded once per item.
NO_PASSAGES = "none"


class RecordStore:
    """Append-only JSONL of per-item records keyed by (item, condition, policy)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: dict[tuple[str, str, str], dict[str, Any]] = {}
        if self.path.exists():
            with self.path.open(encoding="utf-8") as fh:
                for line in fh:
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut by an interruption: that item is redone
                    self.records[self.key(r)] = r
            with self.path.open("rb") as fh:
                fh.seek(0, 2)
                cut = fh.tell() > 0 and (fh.seek(-1, 2), fh.read(1))[1] != b"\n"
            if cut:  # end the partial line so the next record starts on its own line
                with self.path.open("a", encoding="utf-8") as fh:
                    fh.write("\n")

    @staticmethod
    def key(r: dict[str, Any]) -> tuple[str, str, str]:
        return (str(r["item"]), str(r["condition"]), str(r["policy"]))

    def __contains__(self, key: tuple[str, str, str]) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.records[self.key(record)] = record

    def values(self) -> list[dict[str, Any]]:
        return list(self.records.values())


def progress_bar(total: int, initial: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, unit="answer")
