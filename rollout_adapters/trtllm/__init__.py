"""TensorRT-LLM backend (GPU only): `adapter.TRTLLMAdapter` drives AsyncLLM; `protocol` holds the pure
translations. Importing this package does not import tensorrt_llm."""
