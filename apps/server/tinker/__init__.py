"""The Tinker protocol (what the unmodified `tinker` SDK calls) over the training service: `routes.py` (its HTTP
routes, told apart from forge's own on the paths both use), `service.py` (its sessions, models and samplers over
the service's parts), `futures.py` (every call answered with a request id, its result polled), `wire.py` (the
protobuf bodies) and `batches.py` (its datums as a training batch)."""
