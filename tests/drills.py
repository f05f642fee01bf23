"""The drill tier: tests that start process groups, kill and restart services, load the real model or
compile with torch.compile. Each proves something the default tier does not, and each costs 10-30 s
on 2 cores; together they were more than half of the suite's time (about 11 of 20 minutes on an AMD
EPYC with 2 cores). They carry the `drill` marker, given here by node-id prefix.

  .venv/bin/python -m pytest -q            the default tier (pyproject's addopts: -m "not drill")
  .venv/bin/python -m pytest -q -m drill   the drills only
  .venv/bin/python -m pytest -q -m ""      everything
`.ci/run` runs the default tier, then the drills: CI proves both. A representative of each family
stays in the default tier (KEEP), so a change that breaks tensor parallelism or a fault path shows up
in the first ten minutes, not only in CI.
"""

from __future__ import annotations

DRILLS = {
    "tests/test_moe_tp.py::test_two_ranks_match": "MoE TP/EP ranks in process groups",
    "tests/test_moe_tp.py::test_tp_pairs_match_hf_greedy": "MoE TP/EP service pairs (2-4 processes each)",
    "tests/test_moe_tp.py::test_the_latent_is_written_into_every_decode_rank": "MLA handoff into TP decode ranks",
    "tests/test_tp_service.py::test_tp_pairs": "TP service pairs (2-4 processes each)",
    "tests/test_tp_service.py::test_a_dead_rank_ends_its_service_cleanly": "a TP rank killed",
    "tests/test_multinode.py::test_groups_across": "TP groups over two loopback nodes (4 processes)",
    "tests/test_multinode.py::test_a_node_with_another_key": "a node process with a wrong key",
    "tests/test_multinode.py::test_killing_node_1": "a node process killed",
    "tests/test_tensor_parallel.py::test_more_ranks_than_kv_heads_replicate_them": "4 ranks in one group",
    "tests/test_logprobs.py::test_logprobs_and_penalties_with_tensor_parallel_services": "TP service pairs",
    "tests/test_grammar_tp.py": "grammars over TP service pairs",
    "tests/test_retraction.py::test_retraction_over_tp_2_pairs_matches_hf": "retraction over TP service pairs",
    "tests/test_n_samples_eagle.py::test_samples_over_the_grpc_pair_equal_their_twins[grpc-2]": "TP service pairs",
    "tests/test_nextn.py::test_tp_pairs_with_the_mtp_draft": "the MTP draft over TP service pairs",
    "tests/test_triton_moe.py::test_qwen3_moe_through_triton": "Triton interpreter, a whole model",
    "tests/test_triton_latent.py::test_the_mtp_draft_chain_through_triton": "Triton interpreter, a whole model",
    "tests/test_cuda_fused.py::test_a_model_through_the_fused_ops_matches_it_without_them[qwen3-moe]": "Triton "
    "interpreter, MoE (the llama case stays)",
    "tests/test_cuda_fused.py::test_a_model_through_the_fused_ops_matches_it_without_them[deepseek-v3]": "Triton "
    "interpreter, MLA",
    "tests/test_cuda_fused.py::test_moe_and_mla_decode_through_static_buffers_match_hf_greedy[qwen3-moe]": "Triton "
    "interpreter (MoE's padded rows also in test_moe_metrics)",
    "tests/test_faults.py::test_killing_a_prefill_process_under_load_then_restarting_it": "kill and restart",
    "tests/test_faults.py::test_calls_on_a_stopped_replica_are_retried_elsewhere[mooncake]": "replica stopped",
    "tests/test_faults.py::test_sigterm_with_open_streams_and_smg_exits_within_the_grace_period": "SIGTERM drill",
    "tests/test_prefill_replicas.py::test_killing_prefill_processes_mid_handoff": "kill mid-handoff",
    "tests/test_real_model.py": "SmolLM2-135M converted and served",
    "tests/test_cpu_fused_build.py::test_sigterm_mid_build_then_a_restart_builds": "a build killed, two builds",
    "tests/test_kernel_isas.py": "the fused kernels built for the lesser ISAs the host runs (~20 s a build)",
    "tests/test_smg_structured.py": "SmolLM2-135M behind smg: structured output (~70 s)",
    "tests/test_openai_api.py::test_smg_over_http": "smg in front of decode's OpenAI API (a gateway process)",
    "tests/test_faults.py::test_300_requests_with_injected_faults_and_cancels": "a fault soak (~30 s; the other "
    "fault tests stay)",
    "tests/gpu/test_cuda_path.py::test_bf16_teacher_forced_against_fp32[cpu]": "bf16 on CPU against fp32 (~20 s)",
    "tests/test_fp8_checkpoint.py::test_two_ranks_serve_the_dequantized_weights": "TP ranks in process groups",
    "tests/test_multinode.py::test_a_follower_waits_out_an_idle_rank_0": "TP groups over loopback nodes",
    "tests/test_readme_and_ci.py::test_demo_answers_the_france_question_with_the_real_model": "README line 1",
    "tests/test_compiled_layers.py::test_decode_through_torch_compile_matches_hf": "torch.compile",
    "tests/test_triton_attention.py::test_serving_through_triton_matches_hf_greedy[EAGLE": "Triton interpreter",
    "tests/test_intra_op.py::test_only_the_forward_stream_starts_an_openmp_pool": "service processes",
    "tests/test_intra_op.py::test_services_set_their_openmp_spin_before_torch_loads": "service processes",
    "tests/test_decode_prefix_cache.py::test_the_delta_handoff_moves_only_the_new_positions_kv[grpc-2-1]": "TP "
    "service pairs",
    "tests/test_decode_prefix_cache.py::test_the_delta_handoff_moves_only_the_new_positions_kv[shm-1-2]": "TP "
    "service pairs (~19 s; the single-rank transports stay)",
    "tests/test_decode_prefix_cache.py::test_follow_up_turns_with_a_draft_head_keep_its_kv_and_its_accept_rate[EAGLE-"
    "chain-grpc]": "service pairs with a head (the shm tree case stays)",
}

KEEP = (  # one representative per family in the default tier
    "tests/test_tp_service.py::test_tp_pairs_match_hf_greedy[2-1-qwen3-False]",
    "tests/test_moe_tp.py::test_tp_pairs_match_hf_greedy[1-2-qwen3-moe-1-1]",
)


def is_drill(nodeid: str) -> bool:
    return nodeid not in KEEP and any(nodeid.startswith(prefix) for prefix in DRILLS)
