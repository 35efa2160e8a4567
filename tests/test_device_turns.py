"""device_turns: a background compile never runs beside a step (XLA's autotuning and a step's
temporaries share the device's pool: a `paxengine serve` cold start of Qwen3.5-9B ran out of
memory on an H100 when they did)."""

import threading
import time

import jax.numpy as jnp

from paxengine.device_turns import DeviceTurns


def _enter_later(ctx, entered: threading.Event, leave: threading.Event) -> threading.Thread:
    def run():
        with ctx:
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_compile_waits_for_the_step_under_way_and_a_step_for_the_compile():
    turns = DeviceTurns()
    step_in, step_out = threading.Event(), threading.Event()
    a = _enter_later(turns.step(), step_in, step_out)
    assert step_in.wait(5)
    comp_in, comp_out = threading.Event(), threading.Event()
    b = _enter_later(turns.compile(), comp_in, comp_out)
    assert not comp_in.wait(0.3)  # the step holds the device
    step_out.set()
    assert comp_in.wait(5)
    # now a step waits for the compile
    step2_in, step2_out = threading.Event(), threading.Event()
    c = _enter_later(turns.step(), step2_in, step2_out)
    assert not step2_in.wait(0.3)
    comp_out.set()
    assert step2_in.wait(5)
    step2_out.set()
    for t in (a, b, c):
        t.join(5)


def test_compiles_share_a_turn_and_a_waiting_step_goes_before_the_next():
    turns = DeviceTurns()
    first_in, first_out = threading.Event(), threading.Event()
    second_in, second_out = threading.Event(), threading.Event()
    a = _enter_later(turns.compile(), first_in, first_out)
    b = _enter_later(turns.compile(), second_in, second_out)
    assert first_in.wait(5) and second_in.wait(5)  # side by side
    step_in, step_out = threading.Event(), threading.Event()
    c = _enter_later(turns.step(), step_in, step_out)
    time.sleep(0.2)  # the step waits for both
    third_in, third_out = threading.Event(), threading.Event()
    d = _enter_later(turns.compile(), third_in, third_out)
    first_out.set()
    second_out.set()
    assert step_in.wait(5)
    assert not third_in.is_set()  # did not start while the step waited
    step_out.set()
    assert third_in.wait(5)
    third_out.set()
    for t in (a, b, c, d):
        t.join(5)


def test_steps_nest_and_a_compile_waits_for_the_outermost():
    turns = DeviceTurns()
    outer_in, outer_out = threading.Event(), threading.Event()

    def prime():  # the start-up prime: its runs are steps inside a step
        with turns.step():
            for _ in range(3):
                with turns.step():
                    pass
            outer_in.set()
            outer_out.wait(10)

    a = threading.Thread(target=prime, daemon=True)
    a.start()
    assert outer_in.wait(5)
    comp_in, comp_out = threading.Event(), threading.Event()
    b = _enter_later(turns.compile(), comp_in, comp_out)
    assert not comp_in.wait(0.3)
    outer_out.set()
    assert comp_in.wait(5)
    comp_out.set()
    a.join(5)
    b.join(5)


def test_a_compile_after_a_step_whose_output_was_donated_goes_on():
    turns = DeviceTurns()
    x = jnp.ones(4)
    with turns.step():
        turns.dispatched(x)
    x.delete()  # the next step took it
    with turns.compile():
        pass
