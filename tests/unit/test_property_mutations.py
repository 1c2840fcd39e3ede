"""Every property test bites: under each mutation of :data:`mutations.PROPERTY_MUTATIONS` (a subtle bug
in the mechanism it guards), the property test fails.

A property that passes under its mutation does not guard the mechanism. Each case runs the
property over the grid the property test states, on the shapes named here, with the mutation's
patches started, and asserts that it raises AssertionError (the property's own assertion, naming
the shape it failed on, which the test prints).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import pytest
import test_arena_guard
import test_attention_reach
import test_job_check_table
import test_kv_memory_model
import test_memory_arenas
import test_planner_brute_force
import test_planner_exhaustive
import test_shape_grid

from mutations import PROPERTY_MUTATIONS
from torchtitan_seq import plan as planner

PROPERTIES: dict[str, tuple[Callable[..., None], list[tuple]]] = {
    # mutation: (property test, the argument sets it runs on, in order until one fails)
    "reach_views_kept": (
        test_attention_reach.test_views_of_a_unit_go_once_every_unit_that_reads_them_has_run_backward,
        [(5, None), (None, 10)],
    ),
    "reach_arenas_unshared": (
        test_kv_memory_model.test_predicted_kv_context_is_the_measured,
        [("gpt_oss:debugmodel", "reach", "full")],
    ),
    "reach_views_under_checkpointing": (
        test_kv_memory_model.test_predicted_kv_context_is_the_measured,
        [("gpt_oss:debugmodel", "reach", "full")],
    ),
    "guard_other_end_only": (
        test_arena_guard.test_the_guard_refuses_exactly_the_writes_that_overwrite_keys_in_flight,
        [(name,) for name in ("Seq1F1B", "InterleavedSeq1F1B", "BSIPipe", "Chimera")],
    ),
    "guard_own_unit_left_out": (
        test_arena_guard.test_the_guard_refuses_exactly_the_writes_that_overwrite_keys_in_flight,
        [(name,) for name in ("Seq1F1B", "InterleavedSeq1F1B", "BSIPipe", "Chimera")],
    ),
    "shape_cp_tp_apart": (
        test_shape_grid.test_every_tool_cuts_alike_into_chunks_tp_and_cp_can_share,
        [(n,) for n in test_shape_grid.SEQ_LENS],
    ),
    "planner_bound_low": (
        test_planner_exhaustive.test_top_n_is_the_first_n_rows_of_the_exhaustive_table,
        [(*job, overhead) for job in test_planner_exhaustive.JOBS for overhead in (0.0, planner.H200_UNIT_OVERHEAD_S)],
    ),
    "planner_twins_by_tp_only": (
        test_planner_exhaustive.test_top_n_is_the_first_n_rows_of_the_exhaustive_table,
        [(*job, overhead) for job in test_planner_exhaustive.JOBS for overhead in (0.0, planner.H200_UNIT_OVERHEAD_S)],
    ),
    **{
        name: (
            test_planner_brute_force.test_the_search_generates_every_candidate_of_the_brute_force_and_no_other,
            [(flavor,) for flavor in test_planner_brute_force.FLAVORS],
        )
        for name in (
            "planner_tp_degrees_short",
            "planner_cp_degrees_short",
            "planner_pp_range_short",
            "planner_ranks_over_part_of_a_node",
        )
    },
    **{
        name: (
            test_planner_brute_force.test_the_memory_model_and_the_simulator_get_the_candidates_inputs,
            test_planner_brute_force.INPUT_JOBS,
        )
        for name in ("planner_memory_at_simulated_microbatches", "planner_network_without_dp")
    },
    "memory_arenas_unshared": (test_memory_arenas.test_the_memory_models_arenas_are_the_runtimes, [("Seq1F1B",)]),
    "memory_arenas_without_own": (test_memory_arenas.test_the_memory_models_arenas_are_the_runtimes, [("Seq1F1B",)]),
    **{
        name: (test_job_check_table.test_the_check_decides_every_row_as_torchtitan_and_the_kernels_do, [()])
        for name in ("job_check_fsdp_without_cp", "job_check_replicas_cast", "job_check_float32_units_on_cuda")
    },
}


def test_every_property_mutation_has_its_property():
    assert set(PROPERTIES) == set(PROPERTY_MUTATIONS)


@pytest.mark.parametrize("mutation", list(PROPERTY_MUTATIONS))
def test_the_property_fails_under_its_mutation(mutation):
    prop, argument_sets = PROPERTIES[mutation]
    with ExitStack() as stack:
        for patch in PROPERTY_MUTATIONS[mutation]():
            stack.enter_context(patch)
        for args in argument_sets:
            try:
                prop(*args)
            except AssertionError as e:
                print(f"{mutation}: {prop.__name__}{args} fails: {str(e)[:300]}")
                return
    pytest.fail(f"{mutation}: {prop.__name__} passes under the mutation on {argument_sets}")
