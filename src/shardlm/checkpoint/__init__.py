"""Checkpoints: ``io`` (reading DCP files safely), ``layout`` (step directories, the marker, atomic
saves), ``manager`` (save/resume a run's explicit state), ``export`` / ``export_lora`` (consolidation
to Hugging Face safetensors and peft adapters, verified bit for bit)."""
