"""What is read off the model and its config, before any plan: the sizes read once (``geometry``),
config names and module facts (``hf``), the meta build (``meta``), fused experts modules
(``experts``), what peft adds (``adapters``). Imports nothing else of ``parallel/``."""
