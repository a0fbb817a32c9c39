"""A test-only stand-in for torchvision, for SGLang's import on a CPU machine (issue 27).

SGLang 0.5.23 imports torchvision at load (``sglang.srt.configs`` -> ``internvl_utils``, and
transformers' image utilities once torchvision is importable), and the only torchvision wheel for
torch 2.13 is a CUDA build that cannot load against the CPU torch. Nothing the tests drive
(HiCache's controller, host pools, storage) uses torchvision: every submodule
(``torchvision.transforms.v2``, ...) is made on import, and every name in it is a placeholder
that raises if it is ever called. Never installed: the engine scripts under tests/engines put
this folder on ``sys.path`` themselves.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+prefixkv.stub"


class _Unavailable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> "_Unavailable":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a test-only stub here (tests/engines/stubs)")

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{module_name}.{name}")
    return __getattr__


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"torchvision.{name}")
