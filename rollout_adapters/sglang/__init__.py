"""SGLang backend (GPU only): `adapter.SGLangAdapter` drives one SGLang HTTP server; `protocol` holds the pure
request/response translations. Importing this package does not import sglang."""
