"""What is read off the model and its config, before any plan: config sizes and module facts
(``hf``), the meta build (``meta``), fused experts modules (``experts``), state-dict names under
peft (``peft_keys``). Imports nothing else of ``parallel/``."""
