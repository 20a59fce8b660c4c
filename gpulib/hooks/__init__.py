"""The hooks the CloudStack agent and libvirt run around every VM start and stop.

Each module has a `main(argv) -> int`; the executables in `hooks/` only call
it. Nothing here imports click, and a domain without GPU devices is answered
before lxml or the rest of gpulib are imported.
"""
