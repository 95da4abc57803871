"""Which optional parameters a planner's or writer's methods take is asked once per function
(``inspect.signature`` costs ~0.1 ms, twice in every steady-state DCP save), and never
confused between classes, instances or callable objects."""

from __future__ import annotations

from typing import Any

from resilient_ckpt.async_ckpt import _planning
from resilient_ckpt.async_ckpt._planning import accepts


class _Old:
    def set_up_storage_writer(self, is_coordinator: bool) -> None:
        pass


class _New(_Old):
    def set_up_storage_writer(self, is_coordinator: bool, **kwargs: Any) -> None:
        pass


class _Finish:
    """A callable object that is unhashable (defines __eq__ only)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Finish)

    def __call__(self, metadata: Any, results: Any, file_checksums: Any = None) -> None:
        pass


def test_accepts_answers_per_function_and_asks_once(monkeypatch) -> None:
    _planning._parameter_names.cache_clear()
    asked: list[Any] = []
    original = _planning.inspect.signature

    def counting(obj: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(obj)
        return original(obj, *args, **kwargs)

    monkeypatch.setattr(_planning.inspect, "signature", counting)
    for _ in range(3):
        assert accepts(_New().set_up_storage_writer, "kwargs")
        assert not accepts(_Old().set_up_storage_writer, "kwargs")
        assert accepts(_Finish(), "file_checksums") and not accepts(_Finish(), "kwargs")
    # One look per class's function; the unhashable callable object is asked every time.
    functions = [a for a in asked if not isinstance(a, _Finish)]
    assert functions == [_New.set_up_storage_writer, _Old.set_up_storage_writer]
    assert sum(isinstance(a, _Finish) for a in asked) == 6
