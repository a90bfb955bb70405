"""SGLang-side glue: the functions ``sglang.patch`` calls into. Engine-agnostic logic stays in
``akv.system.context``; this package only maps SGLang objects onto it."""
