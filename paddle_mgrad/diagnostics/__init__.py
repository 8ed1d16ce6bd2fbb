"""What tells a user what runs and whether it works: ``python -m paddle_mgrad doctor``
(:mod:`.doctor`: :mod:`.collect` the facts, :mod:`.judge` them, :mod:`.render` the screen;
its Paddle-importing half :mod:`._doctor_probe`), the seed case as a self-test
(:mod:`.selftest`) and the ``main_grad`` audit (:class:`.audit.MainGradAudit`).

Imports nothing of Paddle itself: the doctor must run where Paddle is broken."""
