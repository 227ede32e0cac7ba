"""What forge's two HTTP apps share: the training service (apps.server) and the online-RL gateway (apps.gateway).

Errors as HTTP responses, API-key authentication, the uvicorn server, bounded actor calls, and the model to serve.
"""
