"""The seed's import path for the Hugging Face Trainer integration: `traceml.hf_decorators.TraceMLTrainer`."""
from traceml.integrations.huggingface import TraceMLTrainer, TraceMLTrainerCallback, init

__all__ = ["TraceMLTrainer", "TraceMLTrainerCallback", "init"]
