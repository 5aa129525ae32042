"""The library's foundation, imported by every layer above it: the one Parquet/JSON/safetensors
reader-writer (io), config schemas and their validation (schema, settings, config), the one
registry of methods and datasets (registry), the artifact contract's paths and schemas
(artifacts), provenance records, the runtime (device, threads, determinism), the streaming
reader (stream), training checkpoints, the stages' shared command line (cli, console) and text
tokenisation. Nothing here imports evaluation, datasets, models or anything above them."""
