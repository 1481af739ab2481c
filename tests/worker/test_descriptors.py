"""No class of the package wraps one descriptor in another (``@classmethod`` over
``@classmethod``, ``@staticmethod`` or ``@property``).

Python 3.9 to 3.12 chained such wrappers; 3.13 removed that, and a doubled
``@classmethod`` there is ``TypeError: 'classmethod' object is not callable`` when
called: ``Worker._build`` had one, and neither ``federation-sender worker`` nor
``demo`` could start on 3.13. On 3.11 the doubled decorator works, so only this
inspection finds it before a 3.13 run does.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from types import ModuleType

import federation_sender
from federation_sender.app.worker import Worker

# The batch extra's packages: without the extra, modules that import them are skipped.
BATCH_EXTRA = {"pyspark", "pandas", "pyarrow", "matplotlib"}


def _modules() -> Iterator[ModuleType]:
    for info in pkgutil.walk_packages(federation_sender.__path__, "federation_sender."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue  # runs the command line when imported
        try:
            yield importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in BATCH_EXTRA:
                raise


def _classes(owner: ModuleType | type, module: str) -> Iterator[type]:
    for value in vars(owner).values():
        if inspect.isclass(value) and value.__module__ == module and value is not owner:
            yield value
            yield from _classes(value, module)


def _chained(cls: type) -> Iterator[str]:
    for name, value in vars(cls).items():
        if isinstance(value, classmethod | staticmethod):
            inner = value.__func__
            if isinstance(inner, classmethod | staticmethod | property):
                yield (f"{cls.__module__}.{cls.__qualname__}.{name}: "
                       f"{type(value).__name__} over {type(inner).__name__}")


def test_no_classmethod_or_staticmethod_wraps_another_descriptor() -> None:
    found = [
        problem
        for module in _modules()
        for cls in _classes(module, module.__name__)
        for problem in _chained(cls)
    ]
    assert found == []


def test_worker_build_is_one_classmethod_over_a_coroutine_function() -> None:
    build = inspect.getattr_static(Worker, "_build")
    assert isinstance(build, classmethod)
    assert inspect.iscoroutinefunction(build.__func__)
    assert inspect.iscoroutinefunction(Worker._build)  # callable as cls._build(...)
