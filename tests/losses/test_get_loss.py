import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from losses import LOSSES, get_loss
from losses.registry import REGISTERED_LOSSES, SUPPLIED_BY_TRAINER, SUPPLIED_IF_TAKEN
from losses.cispo import cispo
from losses.dapo import dapo
from losses.distill import distill
from losses.dr_grpo import dr_grpo
from losses.grpo import grpo
from losses.gspo import gspo


def test_registered_names_resolve_to_their_functions():
    expected = {"grpo": grpo, "dapo": dapo, "gspo": gspo, "cispo": cispo, "dr_grpo": dr_grpo, "distill": distill}
    assert LOSSES == expected
    for name, fn in expected.items():
        assert get_loss(name) is fn


def test_each_declared_loss_takes_exactly_its_declared_hyperparameters():
    # The config checks read losses.registry without importing the losses: the declaration must be the signature.
    for name, registered in REGISTERED_LOSSES.items():
        parameters = inspect.signature(get_loss(name)).parameters
        assert set(parameters) - SUPPLIED_BY_TRAINER - SUPPLIED_IF_TAKEN == registered.hyperparams, name
        assert SUPPLIED_BY_TRAINER <= set(parameters), name
    assert REGISTERED_LOSSES["grpo"].hyperparams == {"clip_eps", "kl_coef", "kl_estimator", "tis_cap",
                                                     "token_mask_band", "seq_mask_band"}


def test_the_registry_and_the_package_import_no_torch():
    # A bad config is refused before torch is imported (apps/grpo/cli.py): the checks import losses.registry.
    code = ("import sys, losses, losses.registry; losses.get_loss; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "losses.get_loss('grpo'); assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_a_callable_is_returned_as_is():
    def my_loss(logprobs, batch, *, old_logprobs=None):
        raise AssertionError("not called")

    assert get_loss(my_loss) is my_loss


def test_module_function_path_resolves_a_user_loss(tmp_path, monkeypatch):
    (tmp_path / "my_rl_losses.py").write_text(
        "from losses.grpo import grpo\n\ndef my_grpo(logprobs, batch, **kw):\n    return grpo(logprobs, batch, **kw)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    loss_fn = get_loss("my_rl_losses:my_grpo")
    assert loss_fn.__name__ == "my_grpo" and loss_fn.__module__ == "my_rl_losses"
    assert get_loss("losses.dapo:dapo") is dapo


def test_unknown_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"loss='ppo': unknown; must be one of grpo, dapo, gspo, cispo, dr_grpo, distill, or"):
        get_loss("ppo")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:fn", r"loss='no_such_module_xyz:fn': cannot import module 'no_such_module_xyz'"),
        (":fn", r"loss=':fn': must be 'package.module:function'"),
        ("losses.grpo:nope", r"loss='losses.grpo:nope': module 'losses.grpo' has no callable 'nope'"),
        ("math:pi", r"loss='math:pi': module 'math' has no callable 'pi'"),
    ],
)
def test_bad_module_function_paths(name, message):
    with pytest.raises(ValueError, match=message):
        get_loss(name)


def test_non_string_non_callable_is_a_type_error():
    with pytest.raises(TypeError, match=r"loss=42: must be a loss name, a callable or 'package.module:function'"):
        get_loss(42)
