"""torch.compile policy, regional compile, compile health and cache hygiene (see docs/compile.md).

Import from the submodules (``megacpp.compile.regions``, ``.health``, ``.entry``, ...): this package
itself imports nothing, so reading a `CompileConfig` (``megacpp.compile.config``, imported by
``megacpp.config``) does not load Dynamo, which takes seconds.
"""
