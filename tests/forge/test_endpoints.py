"""forge.endpoints.ActorHandle without Monarch processes: a handle pickled (an endpoint's argument) stays a handle."""

import pickle
from types import SimpleNamespace

from forge.endpoints import ActorHandle


def test_a_handle_pickled_into_another_actors_call_is_still_a_handle_to_the_same_mesh():
    mesh = SimpleNamespace(name="replay_buffer")  # stands in for a Monarch actor mesh, which pickles by reference
    handle = pickle.loads(pickle.dumps(ActorHandle(mesh)))
    assert isinstance(handle, ActorHandle) and handle.name == "replay_buffer"
