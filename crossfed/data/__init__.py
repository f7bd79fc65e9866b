"""Data preparation: a corpus (``corpus``), its tokenizer (``tokenizer``), the window store
sites lease from (``windows``), built in one process (``prepare``) or as N jobs (``scatter``);
``commands`` is ``crossfed data ...``."""
