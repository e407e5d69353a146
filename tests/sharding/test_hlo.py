"""Reading collectives out of HLO text: shapes, replica groups, loops, ring bytes, products.

The reader is tested on programs compiled here (XLA:CPU on the 8 simulated devices), whose
expectations come from the programs as written: the shapes, mesh axes and loop lengths they were
given, and a step-by-step simulation of the ring algorithms. What XLA:CPU never writes is pinned by
excerpts written as the other compilers write them: the TPU compiler's fused and asynchronous
collectives and multi-slice sends, the GPU compiler's asynchronous tuples and its cuBLAS calls,
schedules with work between a collective's start and done, and the replica-group spellings.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gspmd_tp.sharding import hlo, hlo_cost

# --- the ring algorithms, simulated -------------------------------------------------------------


def ring_sent(kind: str, g: int, result_elements: int) -> int:
    """Elements device 0 sends when `g` devices run `kind` on buffers of random numbers whose
    result on one device has `result_elements`, moved step by step and checked against what the
    collective computes. All-reduce is the ring's reduce-scatter then its all-gather; all-to-all
    and collective-permute send straight to their peers."""
    rng = np.random.default_rng(0)
    sent = np.zeros(g, dtype=int)
    if kind == "collective-permute":  # each device's whole buffer to the next
        return result_elements if g > 1 else 0
    # block j of device d goes to device j (a ragged one's blocks here all of one size)
    if kind in ("all-to-all", "ragged-all-to-all"):
        blocks = rng.normal(size=(g, g, result_elements // g))
        out = np.empty_like(blocks)
        for d in range(g):
            for j in range(g):
                out[j, d] = blocks[d, j]
                sent[d] += blocks.shape[2] if j != d else 0
        np.testing.assert_array_equal(out, blocks.transpose(1, 0, 2))
        return int(sent[0])
    if kind == "all-gather":
        shards = rng.normal(size=(g, result_elements // g))
        held = [{d: shards[d]} for d in range(g)]
        for step in range(g - 1):  # each device passes on the shard it received last (its own first)
            for d, k in [(d, (d - step) % g) for d in range(g)]:
                held[(d + 1) % g][k] = held[d][k]
                sent[d] += shards.shape[1]
        for d in range(g):
            np.testing.assert_array_equal(np.concatenate([held[d][k] for k in range(g)]), shards.ravel())
        return int(sent[0])
    chunk = result_elements if kind == "reduce-scatter" else result_elements // g
    x = rng.normal(size=(g, g, chunk))  # (device, chunk, element)
    acc, total = x.copy(), x.sum(axis=0)
    for step in range(g - 1):  # device d adds its running sum of chunk d - step into device d + 1's
        messages = [(d, (d - step) % g, acc[d, (d - step) % g].copy()) for d in range(g)]
        for d, k, data in messages:
            acc[(d + 1) % g, k] += data
            sent[d] += chunk
    for d in range(g):  # device d now holds the whole sum of chunk d + 1
        np.testing.assert_allclose(acc[d, (d + 1) % g], total[(d + 1) % g])
    if kind == "reduce-scatter":
        return int(sent[0])
    for step in range(g - 1):  # and passes the summed chunks round
        messages = [(d, (d + 1 - step) % g, acc[d, (d + 1 - step) % g].copy()) for d in range(g)]
        for d, k, data in messages:
            acc[(d + 1) % g, k] = data
            sent[d] += chunk
    for d in range(g):
        np.testing.assert_allclose(acc[d], total)
    return int(sent[0])


@pytest.mark.parametrize("g", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", hlo.KINDS)
def test_ring_bytes_are_what_the_simulated_ring_sends(kind, g):
    result = 6 * g  # float32 elements of the result on one device
    c = hlo.Collective(kind, "c", "main", result * 4, g, executions=3)
    assert c.ring_bytes == pytest.approx(ring_sent(kind, g, result) * 4)
    assert c.ring_bytes_per_call == pytest.approx(3 * c.ring_bytes)


# --- a program compiled here ------------------------------------------------------------------

# Mesh (x=2, y=4) over the 8 devices, in order: partition id = 4 * x + y.
IDS = np.arange(8).reshape(2, 4)
OVER_Y = [tuple(int(i) for i in row) for row in IDS]  # the groups of a collective over y
OVER_X = [tuple(int(i) for i in col) for col in IDS.T]  # over x
HOST_OF_X = [i // 4 for i in range(8)]  # two hosts, one per row of the mesh (x)

# Per device a: f32[4, 8], b: bf16[2, 8]. name -> (kind, result bytes, groups, runs per call,
# dtype, the jax op it comes from).
EXPECTED = {
    "gathered": ("all-gather", 16 * 8 * 4, OVER_Y, 1, "f32", "all_gather"),
    "gathered_again": ("all-gather", 16 * 8 * 4, OVER_Y, 1, "f32", "all_gather"),
    "scattered": ("reduce-scatter", 2 * 8 * 4, OVER_X, 1, "f32", "reduce_scatter"),
    "nested": ("all-reduce", 4 * 8 * 4, OVER_Y, 2 * 3, "f32", "while/body/closed_call/psum"),
    "counted": ("all-reduce", 4 * 8 * 4, OVER_X, 5, "f32", "while/body/psum"),
    # bf16 asked for; XLA:CPU reduces it in f32: f32 bytes move.
    "half": ("all-reduce", 2 * 8 * 4, OVER_X, 1, "bf16", "psum"),
    "shifted": ("collective-permute", 4 * 8 * 4, [(i, i - i % 4 + (i + 1) % 4) for i in range(8)], 1, "f32",
                "ppermute"),  # to the next device along y, in each row
}  # fmt: skip


def _program(a, b, w):
    gathered = jax.lax.all_gather(a, "y", tiled=True)
    # The same collective again (one shape, groups and op): a shard_map's collectives share one
    # channel_id, and these are two, not copies of one.
    gathered_again = jax.lax.all_gather(jnp.sin(gathered[:4]), "y", tiled=True)
    scattered = jax.lax.psum_scatter(a, "x", tiled=True)

    def inner(c, _):
        return jax.lax.psum(jnp.tanh(c @ w), "y"), None

    nested = jax.lax.scan(lambda c, _: (jax.lax.scan(inner, c, length=3)[0], None), a, length=2)[0]
    step = lambda s: (s[0] + 1, jax.lax.psum(jnp.sin(s[1]), "x"))  # noqa: E731
    counted = jax.lax.while_loop(lambda s: s[0] < 5, step, (0, a))[1]
    half = jax.lax.psum(b, "x")
    shifted = jax.lax.ppermute(a, "y", [(i, (i + 1) % 4) for i in range(4)])
    projected = jnp.tanh(a @ w)  # a product outside the loops, for hlo_cost
    return gathered, gathered_again, scattered, nested, counted, half, shifted, projected


@pytest.fixture(scope="module")
def compiled() -> str:
    """The HLO text of _program compiled for the (x=2, y=4) mesh."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), (jax.sharding.AxisType.Auto,) * 2)
    every = P(("x", "y"))
    mapped = jax.shard_map(_program, mesh=mesh, in_specs=(every, every, P()), out_specs=(every,) * 8,
                           check_vma=False)  # fmt: skip
    args = (jnp.ones((32, 8)), jnp.ones((16, 8), jnp.bfloat16), jnp.ones((8, 8)))
    return jax.jit(mapped).lower(*args).compile().as_text()


def _by_expected(found: list[hlo.Collective]) -> dict[str, hlo.Collective]:
    """The collectives found, named as in EXPECTED (matched by kind, bytes, groups' size and runs;
    the two gathers are alike)."""
    out, left = {}, list(found)
    for name, (kind, size, groups, runs, *_) in EXPECTED.items():
        match = [c for c in left if (c.kind, c.result_bytes, c.group_size, c.executions)
                 == (kind, size, len(groups[0]), runs)]  # fmt: skip
        assert match, (name, found)
        out[name] = match[0]
        left.remove(match[0])
    assert not left, left
    return out


def _line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if re.match(rf"\s*(ROOT )?%{re.escape(name)} = ", line))


def test_each_collective_of_a_compiled_program_with_its_bytes_groups_runs_and_dtype(compiled):
    found = _by_expected(hlo.collectives(compiled, num_devices=8))
    for name, (_, _, groups, _, dtype, op) in EXPECTED.items():
        c = found[name]
        assert hlo.replica_groups(_line(compiled, c.name), 8) == groups, name
        assert c.dtype == dtype and c.promoted == (name == "half"), name
        assert c.op_name.endswith(f"/shard_map/{op}"), (name, c.op_name)


def test_a_loops_trip_count_comes_from_its_config_or_else_its_condition(compiled):
    """XLA writes known_trip_count on both loops; without it, the bound its condition compares
    with; without that, an error."""
    runs = lambda text: sorted(c.executions for c in hlo.collectives(text, 8))  # noqa: E731
    expected = sorted(runs_ for *_, runs_, _, _ in EXPECTED.values())
    assert runs(compiled) == expected
    bare = re.sub(r',"known_trip_count":\{"n":"\d+"\}', "", compiled)
    assert "known_trip_count" not in bare and runs(bare) == expected
    unbounded = re.sub(r"s32\[\] constant\(\d+\)", "s32[] parameter(1)", bare)
    with pytest.raises(ValueError, match="cannot read the trip count of while loop"):
        hlo.executions(unbounded)


def test_a_bf16_all_reduce_xla_cpu_promoted_counts_as_bf16_as_asked(compiled):
    """XLA:CPU runs a bf16 all-reduce in f32 (its reduction computation renamed *_promoted): it
    moves f32, and as_asked counts the bf16 the program asked for."""
    found = _by_expected(hlo.collectives(compiled, 8))
    asked = {c.name: c.result_bytes for c in hlo.as_asked(list(found.values()))}
    assert asked == {c.name: EXPECTED[n][1] // (2 if n == "half" else 1) for n, c in found.items()}
    assert hlo.summarize(list(found.values()))["all-reduce"]["dtypes"] == ["f32", "bf16"]


def test_summary_counts_runs_bytes_and_ring_bytes_per_call(compiled):
    summary = hlo.summarize(hlo.collectives(compiled, 8))
    for kind in hlo.KINDS:
        mine = [e for e in EXPECTED.values() if e[0] == kind]
        assert summary[kind]["count"] == sum(runs for _, _, _, runs, _, _ in mine), kind
        assert summary[kind]["bytes"] == sum(size * runs for _, size, _, runs, _, _ in mine), kind
        ring = sum(
            ring_sent(kind, len(groups[0]), size // 4) * 4 * runs for _, size, groups, runs, _, _ in mine
        )
        assert summary[kind]["ring_bytes_per_device"] == pytest.approx(ring), kind


def test_islands_a_group_spans_with_a_host_per_mesh_row(compiled):
    """Two hosts, one per value of x: groups over y stay on one; groups over x span both with
    one device on each."""
    found = _by_expected(hlo.collectives(compiled, 8, HOST_OF_X))
    spread = {n: (c.islands, c.per_island) for n, c in found.items()}
    assert spread == {
        n: (1, 0) if e[2] in (OVER_Y, EXPECTED["shifted"][2]) else (2, 1) for n, e in EXPECTED.items()
    }
    crossing = sum(ring_sent(e[0], 2, e[1] // 4) * 4 * e[3] for e in EXPECTED.values() if e[2] == OVER_X)
    assert hlo.network_bytes(list(found.values())) == pytest.approx(crossing)
    assert {c.islands for c in hlo.collectives(compiled, 8)} == {1}  # no islands given


def test_xla_cpus_collectives_are_synchronous_and_so_all_exposed(compiled):
    found = hlo.collectives(compiled, 8)
    assert all(c.window == () and not c.hidden for c in found)
    total = sum(c.ring_bytes_per_call for c in found)
    assert hlo.exposure(found) == {"exposed": pytest.approx(total), "hidden": 0}


def test_instruction_costs_of_a_compiled_program_count_its_products_through_loops(compiled):
    """Per device a (4, 8) @ w (8, 8) in the entry and again in each of the nested loops' 2 x 3
    runs: 2 FLOPs per multiply-add. The entry's product reads both operands and writes its result;
    the collectives cost nothing here."""
    costs = hlo_cost.Costs(compiled)
    product = 2 * 4 * 8 * 8
    total, _ = costs.seconds(lambda flops, moved: flops)
    assert total == product + 2 * 3 * product
    entry = costs.parsed[costs.entry]
    (first,) = [i for i in range(len(entry)) if costs.flops_and_bytes(costs.entry, i)[0]]
    assert costs.flops_and_bytes(costs.entry, first) == (product, (4 * 8 + 8 * 8 + 4 * 8) * 4)
    _, per = costs.seconds(lambda flops, moved: flops + moved)
    assert [per[c.computation, c.name] for c in hlo.collectives(compiled, 8)] == [0] * len(EXPECTED)


# --- formats XLA:CPU does not write, as the TPU and GPU compilers write them ----------------------


def test_tpu_fused_all_reduce_scatter_counts_as_a_reduce_scatter():
    text = """\
%all-reduce-scatter (input: f32[4,128,256]) -> f32[4,32,256] {
  %input = f32[4,128,256]{2,1,0} parameter(0)
  %all-reduce.2 = f32[4,128,256]{2,1,0} all-reduce(%input), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}
  ROOT %dynamic-slice.6 = f32[4,32,256]{2,1,0} dynamic-slice(%all-reduce.2, %c, %m, %c)
}

ENTRY %main (p: f32[4,128,256]) -> f32[4,32,256] {
  %p = f32[4,128,256]{2,1,0} parameter(0)
  ROOT %f = f32[4,32,256]{2,1,0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter
}
"""
    (found,) = hlo.collectives(text, num_devices=8)
    assert found.kind == "reduce-scatter" and found.executions == 1
    assert found.result_bytes == 4 * 32 * 256 * 4
    assert found.ring_bytes == pytest.approx(3 / 4 * 4 * 128 * 256 * 4)


def test_tpu_ragged_all_to_all_counts_the_rows_it_sends_from():
    """The TPU compiler's ragged-all-to-all (operands: input, output, input offsets, send sizes,
    output offsets, receive sizes): its payload is its input, 32 rows of 2 x 128 bf16 here, not
    the 64-row buffer it receives into."""
    text = """\
ENTRY %main.0_spmd (param.5: bf16[32,2,128], o: s32[8]) -> bf16[64,2,128] {
  %param.5 = bf16[32,2,128]{2,1,0:T(2,128)(2,1)S(1)} parameter(0)
  %o = s32[8]{0} parameter(1)
  %out = bf16[64,2,128]{2,1,0:T(2,128)(2,1)S(1)} broadcast(%c), dimensions={}
  ROOT %ragged_all_to_all.23 = bf16[64,2,128]{2,1,0:T(2,128)(2,1)S(1)} ragged-all-to-all(%param.5, %out, %o, %o, %o, /*index=5*/%o), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, metadata={op_name="jit(f)/shard_map/ragged_all_to_all" stack_frame_id=2}, backend_config={"collective_algorithm_config":{"emitter":"RaggedAllToAllEmitter"}}
}
"""  # noqa: E501
    (found,) = hlo.collectives(text, num_devices=8)
    assert (found.kind, found.group_size, found.dtype) == ("ragged-all-to-all", 4, "bf16")
    assert found.result_bytes == 32 * 2 * 128 * 2 and found.op_name.endswith("ragged_all_to_all")
    assert found.ring_bytes == pytest.approx(3 / 4 * 32 * 2 * 128 * 2)
    assert hlo.summarize([found])["ragged-all-to-all"]["count"] == 1


def test_a_ragged_all_to_all_compiled_for_a_tpu_slice_is_counted_with_its_payload():
    """jax.lax.ragged_all_to_all over the 8 chips of a v5e slice (XLA:CPU cannot compile it): each
    chip sends from its 32 rows of 128 float32 into a 64-row buffer."""
    pytest.importorskip("libtpu")
    from gspmd_tp.plan import hardware

    mesh = jax.sharding.Mesh(
        np.array(hardware.target_devices("tpu:v5e:2x4")), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
    )

    def send(x, offsets, sizes, out_offsets, recv_sizes):
        out = jnp.zeros((64, 128), x.dtype)
        return jax.lax.ragged_all_to_all(
            x, out, offsets[0], sizes[0], out_offsets[0], recv_sizes[0], axis_name="x"
        )

    spec = lambda shape, dtype: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=jax.sharding.NamedSharding(mesh, P("x"))
    )
    mapped = jax.shard_map(send, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"))
    with hardware.no_cache_writes():
        text = jax.jit(mapped).lower(spec((8 * 32, 128), jnp.float32), *[spec((8, 8), jnp.int32)] * 4)
        text = text.compile().as_text()
    (found,) = [c for c in hlo.collectives(text, 8) if c.kind == "ragged-all-to-all"]
    assert (found.group_size, found.executions, found.dtype) == (8, 1, "f32")
    assert found.result_bytes == 32 * 128 * 4
    assert hlo.summarize(hlo.collectives(text, 8))["ragged-all-to-all"]["ring_bytes_per_device"] == (
        pytest.approx(7 / 8 * 32 * 128 * 4)
    )


def test_an_async_collective_split_into_start_continuation_and_done_counts_once():
    """The TPU compiler's async collectives: a start fusion, continuation fusions and a done fusion,
    each holding a copy of the all-gather with the same channel_id; one all-gather moves the bytes."""
    copy = (
        "  %{name} = bf16[4,32,64]{{2,1,0}} all-gather(%p), channel_id=9, replica_groups=[2,4]<=[8], "
        'dimensions={{1}}, metadata={{op_name="jit(step)/layers/attn/dot_general"}}'
    )
    parts = ["start", "continue.1", "continue.2", "done"]
    text = "\n".join(
        f"%{part} (p: bf16[4,8,64]) -> bf16[4,32,64] {{\n  %p = bf16[4,8,64]{{2,1,0}} parameter(0)\n"
        f"{copy.format(name='all-gather.' + str(i))}\n}}\n"
        for i, part in enumerate(parts)
    )
    calls = "\n".join(
        f"  %f{i} = bf16[4,32,64]{{2,1,0}} fusion(%a), kind=kCustom, calls=%{p}" for i, p in enumerate(parts)
    )
    entry = "ENTRY %main (a: bf16[4,8,64]) -> bf16[4,32,64] {\n  %a = bf16[4,8,64]{2,1,0} parameter(0)\n"
    text += f"\n{entry}{calls}\n}}\n"
    (found,) = hlo.collectives(text, num_devices=8)
    assert found.kind == "all-gather" and found.executions == 1 and found.result_bytes == 4 * 32 * 64 * 2
    assert hlo.summarize([found])["all-gather"]["count"] == 1


def test_gpu_async_collectives_count_the_results_their_done_returns():
    """XLA's GPU compiler returns a combined start's operands beside its results,
    ((operands...), (results...)); the done instruction returns the results alone. Counting the
    start's whole tuple made a reduce-scatter eight times too large on 8 devices."""
    text = """\
ENTRY %main (a: bf16[2048,64], b: f32[2048], c: bf16[256,64]) -> bf16[256,64] {
  %a = bf16[2048,64]{1,0} parameter(0)
  %b = f32[2048]{0} parameter(1)
  %c = bf16[256,64]{1,0} parameter(2)
  %rs-start = ((bf16[2048,64]{1,0}, f32[2048]{0}), (bf16[256,64]{1,0}, f32[256]{0})) reduce-scatter-start(%a, %b), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %rs-done = (bf16[256,64]{1,0}, f32[256]{0}) reduce-scatter-done(%rs-start)
  %ag-start = ((bf16[256,64]{1,0}, bf16[256,64]{1,0}), (bf16[2048,64]{1,0}, bf16[2048,64]{1,0})) all-gather-start(%c, %c), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %ag-done = (bf16[2048,64]{1,0}, bf16[2048,64]{1,0}) all-gather-done(%ag-start)
  %one-start = (bf16[256,64]{1,0}, bf16[2048,64]{1,0}) all-gather-start(%c), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}
  %one-done = bf16[2048,64]{1,0} all-gather-done(%one-start)
  ROOT %r = bf16[256,64]{1,0} get-tuple-element(%rs-done), index=0
}
"""  # noqa: E501
    found = {c.name: c for c in hlo.collectives(text, num_devices=8)}
    assert set(found) == {"rs-start", "ag-start", "one-start"}
    assert found["rs-start"].result_bytes == 256 * 64 * 2 + 256 * 4
    assert found["rs-start"].ring_bytes == 7 * (256 * 64 * 2 + 256 * 4)
    assert found["ag-start"].result_bytes == 2 * 2048 * 64 * 2
    assert found["one-start"].result_bytes == 2048 * 64 * 2


@pytest.mark.parametrize(
    "attributes, groups",
    [
        ("replica_groups={{0,2},{1,3}}, to_apply=%add", [(0, 2), (1, 3)]),
        ("replica_groups={}, to_apply=%add", [(0, 1, 2, 3)]),
        ("replica_groups=[2,2]<=[4], dimensions={0}", [(0, 1), (2, 3)]),
        ("replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}", [(0, 2), (1, 3)]),
        ("replica_groups=mesh['x'=2,'y'=2] {'x'}, use_global_device_ids=true", [(0, 2), (1, 3)]),
        (
            "replica_groups=mesh['x'=2,'y'=2], device_ids=([2,2]T(1,0)) {'y'}, dimensions={0}",
            [(0, 2), (1, 3)],
        ),
        ("source_target_pairs={{0,1},{1,2},{2,3}}", [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_replica_groups_in_every_spelling(attributes, groups):
    assert hlo.replica_groups(attributes, num_devices=4) == groups
    assert hlo.group_size(attributes, num_devices=4) == len(groups[0])


def test_device_islands_place_each_device_on_its_process_host():
    from types import SimpleNamespace

    def devices(platform, processes):
        return [SimpleNamespace(platform=platform, process_index=p) for p in processes]

    # SLURM: one process per GPU, four processes on each of two hosts.
    gpus = devices("gpu", range(8))
    assert hlo.device_islands(gpus, [0, 0, 0, 0, 1, 1, 1, 1]) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert hlo.device_islands(gpus, [0] * 8) is None  # all on one host
    assert hlo.device_islands(devices("gpu", [0, 0, 1, 1])) == [0, 0, 1, 1]  # no hosts given: a process each
    assert hlo.device_islands(devices("cpu", [0, 1]), [0, 1]) == [0, 1]
    # A TPU program names its transfers between slices itself.
    assert hlo.device_islands(devices("tpu", [0, 1]), [0, 1]) is None


def test_megascale_sends_are_the_dcn_collectives_of_a_multi_slice_program():
    """Written as the TPU compiler writes them for two slices of four devices: an all-reduce's send
    and recv share a rendezvous name and shape; an all-gather's recv is the slices' pieces together."""
    attrs = (
        "is_host_transfer=true, frontend_attributes="
        '{{_xla_host_transfer_handler_name="xla_megascale_runtime",'
        '_xla_host_transfer_rendezvous="{name}",_xla_megascale_target="{{1,2}}x{{0:3}}",'
        '_xla_megascale_transfer_type="{kind}"}}'
    )
    text = f"""\
%body (p: (s32[], f32[16,8,128])) -> (s32[], f32[16,8,128]) {{
  %p = (s32[], f32[16,8,128]{{2,1,0}}) parameter(0)
  %v = f32[16,8,128]{{2,1,0}} get-tuple-element(%p), index=1
  %after-all.1 = token[] after-all()
  %send.1 = (f32[16,8,128]{{2,1,0:T(8,128)}}, u32[], token[]) send(%v, %after-all.1), channel_id=6, {attrs.format(name="all-reduce.5_0", kind="ALL_REDUCE")}
  %recv.1 = (f32[16,8,128]{{2,1,0:T(8,128)}}, u32[], token[]) recv(%after-all.1), channel_id=5, {attrs.format(name="all-reduce.5_0", kind="ALL_REDUCE")}
  %send-done.1 = token[] send-done(%send.1), channel_id=6, {attrs.format(name="all-reduce.5_0", kind="ALL_REDUCE")}
  ROOT %t = (s32[], f32[16,8,128]{{2,1,0}}) tuple(%i, %v)
}}

ENTRY %main (a: f32[1,64]) -> f32[2,64] {{
  %a = f32[1,64]{{1,0}} parameter(0)
  %w = (s32[], f32[16,8,128]{{2,1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  %after-all.2 = token[] after-all()
  %send.2 = (f32[1,64]{{1,0}}, u32[], token[]) send(%a, %after-all.2), channel_id=8, {attrs.format(name="all-gather.7_0", kind="ALL_GATHER")}
  %recv.2 = (f32[2,64]{{1,0}}, u32[], token[]) recv(%after-all.2), channel_id=7, {attrs.format(name="all-gather.7_0", kind="ALL_GATHER")}
  ROOT %r = f32[2,64]{{1,0}} get-tuple-element(%recv.2), index=0
}}
"""  # noqa: E501
    found = {c.name: c for c in hlo.collectives(text, num_devices=4)}
    assert set(found) == {"send.1", "send.2"}
    reduce, gather = found["send.1"], found["send.2"]
    assert (reduce.kind, reduce.group_size, reduce.executions, reduce.islands) == ("all-reduce", 2, 3, 2)
    assert reduce.result_bytes == 16 * 8 * 128 * 4 and reduce.ring_bytes == reduce.result_bytes
    assert (gather.kind, gather.result_bytes, gather.ring_bytes) == ("all-gather", 2 * 64 * 4, 64 * 4)


# fmt: off
SCHEDULED = """\
HloModule m, is_scheduled=true

%fused_dot (p0: f32[64,32], p1: f32[32,16]) -> f32[64,16] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = f32[32,16]{1,0} parameter(1)
  ROOT %d = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[64,32], w: f32[32,16]) -> f32[64,64] {
  %a = f32[64,32]{1,0} parameter(0)
  %w = f32[32,16]{1,0} parameter(1)
  %hid-start = (f32[64,32]{1,0}, f32[64,128]{1,0}) all-gather-start(%a), channel_id=1, replica_groups=[2,4]<=[8], dimensions={1}
  %mm = f32[64,16]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_dot
  %hid-done = f32[64,128]{1,0} all-gather-done(%hid-start)
  %bare-start = (f32[64,16]{1,0}, f32[64,64]{1,0}) all-gather-start(%mm), channel_id=2, replica_groups=[2,4]<=[8], dimensions={1}
  %gte = f32[64,16]{1,0} get-tuple-element(%bare-start), index=0
  %bare-done = f32[64,64]{1,0} all-gather-done(%bare-start)
  %sync = f32[64,64]{1,0} all-reduce(%bare-done), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %r = f32[64,64]{1,0} add(%sync, %sync)
}
"""  # noqa: E501
# fmt: on


def test_schedule_window_an_async_gather_with_a_product_between_start_and_done_is_hidden():
    found = {c.name: c for c in hlo.collectives(SCHEDULED, num_devices=8)}
    assert found["hid-start"].window == ("mm",) and found["hid-start"].hidden
    assert found["hid-start"].scheduled_in == "main"
    # Back to back (a get-tuple-element between computes nothing), and synchronous: exposed.
    assert found["bare-start"].window == () and not found["bare-start"].hidden
    assert found["sync"].window == () and not found["sync"].hidden
    split = hlo.exposure(list(found.values()))
    assert split["hidden"] == pytest.approx(found["hid-start"].ring_bytes)
    assert split["exposed"] == pytest.approx(found["bare-start"].ring_bytes + found["sync"].ring_bytes)


def test_schedule_window_of_the_tpus_start_continuation_and_done_fusions():
    """A copy of the collective in each of three fusions (one channel): the window runs from the
    start fusion to the done fusion, a continuation is not compute, a product between them is."""
    gather = (
        "  %{name} = bf16[4,32]{{1,0}} all-gather(%p), channel_id=9, replica_groups=[2,4]<=[8], "
        "dimensions={{1}}"
    )
    parts = ["start", "cont", "done"]
    text = "".join(
        f"%{part} (p: bf16[4,8]) -> bf16[4,32] {{\n  %p = bf16[4,8]{{1,0}} parameter(0)\n"
        f"{gather.format(name='all-gather.' + part)}\n}}\n\n"
        for part in parts
    )
    text += SCHEDULED.split("ENTRY")[0].split("\n", 2)[2]  # %fused_dot
    text += """ENTRY %main (a: bf16[4,8], x: f32[64,32], w: f32[32,16]) -> bf16[4,32] {
  %a = bf16[4,8]{1,0} parameter(0)
  %x = f32[64,32]{1,0} parameter(1)
  %w = f32[32,16]{1,0} parameter(2)
  %f0 = bf16[4,32]{1,0} fusion(%a), kind=kCustom, calls=%start
  %f1 = bf16[4,32]{1,0} fusion(%f0), kind=kCustom, calls=%cont
  %mm = f32[64,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  ROOT %f2 = bf16[4,32]{1,0} fusion(%f1), kind=kCustom, calls=%done
}
"""
    (found,) = hlo.collectives(text, num_devices=8)
    assert found.window == ("mm",) and found.scheduled_in == "main"
    back_to_back = text.replace(
        "  %mm = f32[64,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot\n", ""
    )
    (found,) = hlo.collectives(back_to_back, num_devices=8)
    assert found.window == ()
    # A continuation fusion that carries the gather's progress beside a product of its own computes.
    computing = back_to_back.replace(
        "  %all-gather.cont = ",
        "  %q = bf16[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={0}, rhs_contracting_dims={0}\n"
        "  %all-gather.cont = ",
    )
    (found,) = hlo.collectives(computing, num_devices=8)
    assert found.window == ("f1",)


def test_a_cublas_gemm_custom_call_counts_its_flops():
    from gspmd_tp.sharding import hlo_cost

    text = """\
ENTRY %main (a: bf16[32,64], b: bf16[64,16]) -> bf16[32,16] {
  %a = bf16[32,64]{1,0} parameter(0)
  %b = bf16[64,16]{1,0} parameter(1)
  ROOT %g = (bf16[32,16]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
}
"""  # noqa: E501
    flops, moved = hlo_cost.Costs(text).flops_and_bytes("main", 2)
    assert flops == 2 * 32 * 16 * 64 and moved == (32 * 64 + 64 * 16 + 32 * 16) * 2 + 1024
