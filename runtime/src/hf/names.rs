//! Where each of parc's parameters lives in a transformers checkpoint: tensor names and
//! layouts per family, as one map read both ways (export scatters parc's elements into the
//! transformers tensors, import gathers them back).
//!
//! A parc parameter (`[rows, cols]`, or `[rows]`) is cut into row ranges ([`Piece`]s), each a
//! transformers tensor of `[hf_rows, cols]` (`[cols, hf_rows]` when transposed: GPT-2's
//! Conv1D stores `[in, out]`) whose first rows it fills. Rows no piece covers are padding:
//! the spec's vocabulary beyond transformers' (zeros on import, dropped on export).
//!
//! | parc | GPT-2 (`transformer.`) | Llama / Qwen2 / Qwen3 (`model.`) |
//! |---|---|---|
//! | `embed.weight` | `wte.weight` | `embed_tokens.weight` |
//! | `pos.weight` | `wpe.weight` | — |
//! | `B.ln1.*` | `h.i.ln_1.*` | `layers.i.input_layernorm.weight` |
//! | `B.attn.wqkv` | `h.i.attn.c_attn.weight` (transposed) | `layers.i.self_attn.{q,k,v}_proj.weight` (its rows q, k, v) |
//! | `B.attn.bqkv` | `h.i.attn.c_attn.bias` | `layers.i.self_attn.{q,k,v}_proj.bias` |
//! | `B.attn.q_norm`, `k_norm` | — | `layers.i.self_attn.{q,k}_norm.weight` (Qwen3) |
//! | `B.attn.wo`, `bo` | `h.i.attn.c_proj.*` (weight transposed) | `layers.i.self_attn.o_proj.*` |
//! | `B.ln2.*` | `h.i.ln_2.*` | `layers.i.post_attention_layernorm.weight` |
//! | `B.mlp.fc`, `fc_bias` | `h.i.mlp.c_fc.*` (weight transposed) | — |
//! | `B.mlp.proj`, `proj_bias` | `h.i.mlp.c_proj.*` (weight transposed) | — |
//! | `B.mlp.gate`, `up`, `down` | — | `layers.i.mlp.{gate,up,down}_proj.weight` |
//! | `ln_f.*` | `ln_f.*` | `norm.weight` |
//! | `head.weight` (untied) | — | `lm_head.weight` (no prefix) |
use super::family::{Arch, Family};
use std::ops::Range;

/// Rows of a parc parameter stored as one transformers tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub hf: String,
    /// The parc parameter's rows (its elements when it is 1-D).
    pub rows: Range<u64>,
    /// Rows of the transformers tensor (at least `rows`' length: GPT-2's position table may
    /// hold more positions than the spec's seq).
    pub hf_rows: u64,
    /// Stored `[cols, hf_rows]`.
    pub transposed: bool,
    /// Elements per row (1 for a 1-D parameter).
    pub cols: u64,
    /// The parameter is 1-D (so is the tensor).
    pub vector: bool,
}

impl Piece {
    /// The transformers tensor's shape.
    pub fn hf_shape(&self) -> Vec<u64> {
        match (self.vector, self.transposed) {
            (true, _) => vec![self.hf_rows],
            (false, false) => vec![self.hf_rows, self.cols],
            (false, true) => vec![self.cols, self.hf_rows],
        }
    }

    /// The transformers tensor's flat index of the parameter's row `row` (in `rows`), column
    /// `col`.
    pub fn hf_index(&self, row: u64, col: u64) -> u64 {
        let r = row - self.rows.start;
        if self.transposed {
            col * self.hf_rows + r
        } else {
            r * self.cols + col
        }
    }
}

/// One parc parameter and where its rows go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamMap {
    /// The parameter's name in parc's table (`blocks.0.attn.wqkv`).
    pub parc: String,
    /// Its global shape.
    pub shape: Vec<u64>,
    pub pieces: Vec<Piece>,
}

impl ParamMap {
    /// The position in `pieces` of the piece holding the parameter's flat element `index`,
    /// and that element's index in the piece's tensor; None for a padding row.
    pub fn locate(&self, index: u64) -> Option<(usize, u64)> {
        let cols = self.shape.get(1..).map_or(1, |d| d.iter().product::<u64>());
        let (row, col) = (index / cols.max(1), index % cols.max(1));
        let at = self.pieces.iter().position(|p| p.rows.contains(&row))?;
        let piece = self.pieces.get(at)?;
        Some((at, piece.hf_index(row, col)))
    }
}

/// The sizes on transformers' side that may differ from the spec's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfSizes {
    /// `vocab_size` (at most the spec's vocab: its rows beyond are padding).
    pub vocab: u64,
    /// GPT-2's `n_positions` (at least the spec's seq).
    pub positions: u64,
}

/// Every parc parameter of `arch` and its pieces, in the order of parc's table.
pub fn tensor_map(arch: &Arch, sizes: HfSizes) -> Vec<ParamMap> {
    let mut maps = Builder {
        maps: Vec::new(),
        arch,
    };
    match arch.family {
        Family::Gpt2 => maps.gpt2(sizes),
        Family::Llama | Family::Qwen2 | Family::Qwen3 => maps.llama(sizes),
    }
    maps.maps
}

struct Builder<'a> {
    maps: Vec<ParamMap>,
    arch: &'a Arch,
}

impl Builder<'_> {
    /// Parameter `parc` of `shape` stored as the one tensor `hf`: `extent` is (the parameter's
    /// rows it holds, counted from the first: the rest is padding; the tensor's rows), `t`
    /// transposed.
    fn whole(&mut self, parc: String, shape: Vec<u64>, hf: String, extent: (u64, u64), t: bool) {
        let (rows, hf_rows) = extent;
        self.split(parc, shape, vec![(hf, 0..rows, hf_rows)], t);
    }

    /// Parameter `parc` of `shape`, its row ranges stored as the named tensors (each with its
    /// rows), `t` transposed.
    fn split(
        &mut self,
        parc: String,
        shape: Vec<u64>,
        parts: Vec<(String, Range<u64>, u64)>,
        t: bool,
    ) {
        let cols = shape.get(1..).map_or(1, |d| d.iter().product::<u64>());
        let vector = shape.len() == 1;
        let pieces = parts
            .into_iter()
            .map(|(hf, rows, hf_rows)| Piece {
                hf,
                rows,
                hf_rows,
                transposed: t && !vector,
                cols,
                vector,
            })
            .collect();
        self.maps.push(ParamMap {
            parc,
            shape,
            pieces,
        });
    }

    /// A parameter stored whole, untransposed, under its own shape.
    fn same(&mut self, parc: String, shape: Vec<u64>, hf: String) {
        let rows = shape.first().copied().unwrap_or(1);
        self.whole(parc, shape, hf, (rows, rows), false);
    }

    /// A Linear weight `[out, in]` stored transposed (a GPT-2 Conv1D).
    fn conv1d(&mut self, parc: String, out: u64, inp: u64, hf: String) {
        self.whole(parc, vec![out, inp], hf, (out, out), true);
    }

    fn gpt2(&mut self, sizes: HfSizes) {
        let a = self.arch;
        let (d, f) = (a.dim, a.ffn);
        let t = |s: &str| format!("transformer.{s}");
        self.whole(
            format!("{}.weight", a.embed),
            vec![a.vocab, d],
            t("wte.weight"),
            (sizes.vocab, sizes.vocab),
            false,
        );
        if let Some(pos) = &a.pos {
            let shape = vec![a.seq, d];
            let extent = (a.seq, sizes.positions);
            self.whole(
                format!("{pos}.weight"),
                shape,
                t("wpe.weight"),
                extent,
                false,
            );
        }
        for (i, b) in a.blocks.iter().enumerate() {
            let h = |s: &str| t(&format!("h.{i}.{s}"));
            for (node, hf) in [(&b.ln1, "ln_1"), (&b.ln2, "ln_2")] {
                for p in ["weight", "bias"] {
                    self.same(format!("{node}.{p}"), vec![d], h(&format!("{hf}.{p}")));
                }
            }
            let attn = &b.attn;
            self.conv1d(format!("{attn}.wqkv"), 3 * d, d, h("attn.c_attn.weight"));
            self.same(format!("{attn}.bqkv"), vec![3 * d], h("attn.c_attn.bias"));
            self.conv1d(format!("{attn}.wo"), d, d, h("attn.c_proj.weight"));
            self.same(format!("{attn}.bo"), vec![d], h("attn.c_proj.bias"));
            let mlp = &b.mlp;
            self.conv1d(format!("{mlp}.fc"), f, d, h("mlp.c_fc.weight"));
            self.same(format!("{mlp}.fc_bias"), vec![f], h("mlp.c_fc.bias"));
            self.conv1d(format!("{mlp}.proj"), d, f, h("mlp.c_proj.weight"));
            self.same(format!("{mlp}.proj_bias"), vec![d], h("mlp.c_proj.bias"));
        }
        for p in ["weight", "bias"] {
            self.same(format!("{}.{p}", a.ln_f), vec![d], t(&format!("ln_f.{p}")));
        }
    }

    fn llama(&mut self, sizes: HfSizes) {
        let a = self.arch;
        let (d, f) = (a.dim, a.ffn);
        let (q, kv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
        let m = |s: &str| format!("model.{s}");
        let vocab = (sizes.vocab, sizes.vocab);
        let embed = format!("{}.weight", a.embed);
        self.whole(
            embed,
            vec![a.vocab, d],
            m("embed_tokens.weight"),
            vocab,
            false,
        );
        for (i, b) in a.blocks.iter().enumerate() {
            let l = |s: &str| m(&format!("layers.{i}.{s}"));
            self.same(
                format!("{}.weight", b.ln1),
                vec![d],
                l("input_layernorm.weight"),
            );
            let ln2 = format!("{}.weight", b.ln2);
            self.same(ln2, vec![d], l("post_attention_layernorm.weight"));
            let attn = &b.attn;
            let qkv = |kind: &str| {
                let proj = |p: &str| l(&format!("self_attn.{p}_proj.{kind}"));
                vec![
                    (proj("q"), 0..q, q),
                    (proj("k"), q..q + kv, kv),
                    (proj("v"), q + kv..q + 2 * kv, kv),
                ]
            };
            let rows = q + 2 * kv;
            self.split(format!("{attn}.wqkv"), vec![rows, d], qkv("weight"), false);
            if a.qkv_bias {
                self.split(format!("{attn}.bqkv"), vec![rows], qkv("bias"), false);
            }
            if a.family == Family::Qwen3 {
                for n in ["q_norm", "k_norm"] {
                    let hf = l(&format!("self_attn.{n}.weight"));
                    self.same(format!("{attn}.{n}"), vec![a.head_dim], hf);
                }
            }
            self.same(
                format!("{attn}.wo"),
                vec![d, q],
                l("self_attn.o_proj.weight"),
            );
            if a.out_bias {
                self.same(format!("{attn}.bo"), vec![d], l("self_attn.o_proj.bias"));
            }
            let mlp = &b.mlp;
            self.same(format!("{mlp}.gate"), vec![f, d], l("mlp.gate_proj.weight"));
            self.same(format!("{mlp}.up"), vec![f, d], l("mlp.up_proj.weight"));
            self.same(format!("{mlp}.down"), vec![d, f], l("mlp.down_proj.weight"));
        }
        self.same(format!("{}.weight", a.ln_f), vec![d], m("norm.weight"));
        if !a.tied {
            let head = format!("{}.weight", a.head);
            self.whole(
                head,
                vec![a.vocab, d],
                "lm_head.weight".into(),
                vocab,
                false,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(rows: Range<u64>, hf_rows: u64, transposed: bool) -> Piece {
        Piece {
            hf: "t".into(),
            rows,
            hf_rows,
            transposed,
            cols: 3,
            vector: false,
        }
    }

    #[test]
    fn pieces_index_their_tensor_row_major_or_transposed() {
        // Rows 2..4 of a [6, 3] parameter as a [2, 3] tensor, or a [3, 2] one transposed.
        let plain = piece(2..4, 2, false);
        assert_eq!(plain.hf_shape(), vec![2, 3]);
        assert_eq!(plain.hf_index(3, 1), 4);
        let transposed = piece(2..4, 2, true);
        assert_eq!(transposed.hf_shape(), vec![3, 2]);
        assert_eq!(transposed.hf_index(3, 1), 3);
        // A longer tensor (more positions than the spec's seq): rows keep their stride.
        let longer = piece(0..2, 5, true);
        assert_eq!(longer.hf_shape(), vec![3, 5]);
        assert_eq!(longer.hf_index(1, 2), 11);
    }

    #[test]
    fn padding_rows_have_no_place() {
        let map = ParamMap {
            parc: "embed.weight".into(),
            shape: vec![6, 3],
            pieces: vec![piece(0..4, 4, false)],
        };
        assert_eq!(map.locate(4).map(|(_, i)| i), Some(4));
        assert!(map.locate(12).is_none());
    }
}
