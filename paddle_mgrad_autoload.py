"""Run by ``paddle_mgrad_autoload.pth`` at every interpreter start (installed by pip).

Imports nothing but ``os`` and returns at once unless ``PADDLE_MGRAD`` is set to
something other than empty/``0``.  Then it installs a one-shot import hook: on
the process's first ``import paddle`` it imports ``zlib`` first (Paddle 2.6
crashes otherwise), lets Paddle import, and calls
``paddle_mgrad.autoload._activate_from_hook()`` (see that module).
"""

import os as _os


class _PaddleImportHook:
    """A meta-path finder that only answers for ``paddle``, once."""

    def find_spec(self, name, path=None, target=None):
        if name != "paddle":
            return None
        import sys

        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; also lets the lookup below skip us
        import importlib.util
        import zlib  # noqa: F401  (must precede paddle on Paddle 2.6)

        spec = importlib.util.find_spec("paddle")
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_activate(module):
            try:
                exec_module(module)
            finally:
                try:
                    del loader.exec_module  # the instance attribute set below
                except AttributeError:
                    pass
            _activate()

        loader.exec_module = exec_then_activate
        return spec


#: set when Paddle was imported by paddle_mgrad's own ``__init__`` (``import paddle_mgrad``
#: before ``import paddle``): the package cannot be used half-initialised, so its
#: ``__init__`` activates at its end instead.
pending = False


def fail(error):
    """A bad ``PADDLE_MGRAD*`` value: one line on stderr, exit code 2 (no traceback)."""
    import sys

    print(f"paddle_mgrad: error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _activate():
    import sys

    mg = sys.modules.get("paddle_mgrad")
    if mg is not None and getattr(getattr(mg, "__spec__", None), "_initializing", False):
        global pending
        pending = True
        return
    try:
        from paddle_mgrad.autoload import _activate_from_hook
    except Exception as e:
        # ``import paddle_mgrad`` validates every PADDLE_MGRAD* variable (paddle_mgrad.env)
        errors = sys.modules.get("paddle_mgrad.errors")
        if errors is not None and isinstance(e, errors.FlagError):
            fail(e)
        raise
    _activate_from_hook()


def _install():
    value = _os.environ.get("PADDLE_MGRAD")
    if value is None or value.strip() in ("", "0"):
        return False
    import sys

    if "paddle" in sys.modules:  # not at interpreter start; activate right away
        _activate()
        return True
    if not any(isinstance(f, _PaddleImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PaddleImportHook())
    return True


_install()
