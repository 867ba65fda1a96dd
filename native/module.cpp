// eesd_local._native: the Python face of the round loop (rounds.hpp) and of the maths the
// tests compare with numpy. Bindings only: argument conversion, keeping alive the arrays the
// loop reads and writes, releasing the GIL around the rounds.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "capture.hpp"
#include "probs.hpp"
#include "rounds.hpp"
#include "simd.hpp"
#include "verify.hpp"

namespace py = pybind11;

#ifndef EESD_LLAMA_CPP_VERSION
#error "EESD_LLAMA_CPP_VERSION must name the llama-cpp-python version this is built against"
#endif

namespace {

using StateArray = py::array_t<double, py::array::c_style>;  // no forcecast: the controller's own array, written in place
using CancelArray = py::array_t<uint8_t, py::array::c_style>;
using Logits = py::array_t<float, py::array::c_style | py::array::forcecast>;

// Rounds, holding the arrays whose data it reads and writes between calls
struct PyRounds : eesd::Rounds {
    using eesd::Rounds::Rounds;
    StateArray state;
    CancelArray cancel;
    py::object store;  // the Store the rounds read (kept alive while they may)
};

void configure(PyRounds& self, StateArray state, int mode, double temperature, int top_k, double top_p, uint64_t rng_state,
               double budget_s, CancelArray cancel) {
    if (state.ndim() != 1) throw py::value_error("the controller state must be a 1-d float64 array");
    if (cancel.ndim() != 1 || cancel.shape(0) < 1) throw py::value_error("cancel must be a 1-d uint8 array of size >= 1");
    self.configure(state.mutable_data(), static_cast<int64_t>(state.shape(0)), mode, eesd::sampling_of(temperature, top_k, top_p),
                   rng_state, budget_s, cancel.data());
    self.state = std::move(state);
    self.cancel = std::move(cancel);
}

// [(drafted, accepted, next token, t_draft, t_verify, max_n, room before the round, source,
//   rows in the verify batch)]: nine fields a round
py::list run_batch(PyRounds& self, size_t n_history, int draft_max, int left, int max_rounds) {
    {
        py::gil_scoped_release unlocked;
        self.run_batch(n_history, draft_max, left, max_rounds);
    }
    const std::vector<eesd::RoundOut>& recs = self.batch();
    const std::vector<llama_token>& toks = self.drafted();
    py::list out(recs.size());
    for (size_t i = 0; i < recs.size(); i++) {
        const eesd::RoundOut& r = recs[i];
        size_t end = i + 1 < recs.size() ? recs[i + 1].first : toks.size();
        std::vector<llama_token> d(toks.begin() + r.first, toks.begin() + end);
        out[i] = py::make_tuple(std::move(d), r.m, r.nxt, r.t_draft, r.t_verify, r.max_n, r.room, r.src, r.rows);
    }
    return out;
}

// mode CALL: the Python drafter's round, called with the GIL held. f(new history tokens, max_n,
// rng state) -> (tokens, confidences, [q or None per token] or None, t_catchup, source, offer tokens,
// offer match, rng state)
void set_call(PyRounds& self, py::object f) {
    if (f.is_none()) {
        self.set_call(nullptr);
        return;
    }
    auto holder = std::make_shared<py::object>(std::move(f));
    self.set_call([holder](const llama_token* toks, size_t n, int max_n, eesd::TokenRng& rng, eesd::Called& out) {
        py::gil_scoped_acquire gil;
        py::list fresh(n);
        for (size_t i = 0; i < n; i++) fresh[i] = toks[i];
        py::tuple r = (*holder)(fresh, max_n, rng.s);
        if (r.size() != 8) throw std::invalid_argument("the drafter's round call must return 8 values");
        out.toks = r[0].cast<std::vector<llama_token>>();
        out.conf = r[1].cast<std::vector<double>>();
        if (!r[2].is_none()) {
            for (py::handle q : r[2]) {
                if (q.is_none()) {
                    out.q.emplace_back();
                } else {
                    auto a = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(q);
                    if (!a || a.ndim() != 1) throw std::invalid_argument("a draft distribution must be a 1-d array of floats");
                    out.q.emplace_back(a.data(), a.data() + a.shape(0));
                }
            }
        }
        out.t_catchup = r[3].cast<double>();
        out.src = r[4].cast<int>();
        out.offer = r[5].cast<std::vector<llama_token>>();
        out.offer_match = r[6].cast<int>();
        rng.s = r[7].cast<uint64_t>();
    });
}

const float* logit_row(const Logits& logits) {
    if (logits.ndim() != 1 || logits.shape(0) < 1) throw py::value_error("logits must be a non-empty 1-d array");
    return logits.data();
}

// the processed distribution p of one row (top-k, top-p, temperature), for tests
py::array_t<double> probs(const Logits& logits, double temperature, int top_k, double top_p) {
    const float* row = logit_row(logits);
    int n = static_cast<int>(logits.shape(0));
    eesd::Dist out;
    eesd::Probs pr;
    pr.compute(row, n, eesd::sampling_of(temperature, top_k, top_p), out);
    py::array_t<double> res(n);
    std::copy(out.v.begin(), out.v.end(), res.mutable_data());
    return res;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "The speculative round of eesd_local in C++ against llama-cpp-python's libllama";
    m.attr("LLAMA_CPP_VERSION") = EESD_LLAMA_CPP_VERSION;
    m.attr("LOOKUP_MIN_MATCH") = eesd::LOOKUP_MIN_MATCH;  // the shortest match a lookup or store offer is made at
    // libllama's ABI changes between llama-cpp-python releases: refuse any other one
    auto have = py::module_::import("llama_cpp").attr("__version__").cast<std::string>();
    if (have != EESD_LLAMA_CPP_VERSION)
        throw py::import_error(std::string("eesd_local._native was built for llama-cpp-python ") + EESD_LLAMA_CPP_VERSION +
                               " but " + have + " is installed: rebuild it with `pip install --no-build-isolation -e .`");
    py::register_exception<eesd::ContextFull>(m, "ContextFull", PyExc_RuntimeError);

    py::class_<PyRounds>(m, "Rounds")
        .def(py::init<uintptr_t, int, uintptr_t, int, uintptr_t, uintptr_t, uintptr_t, int>(), py::arg("target"),
             py::arg("target_batch"), py::arg("draft"), py::arg("draft_batch"), py::arg("begin"), py::arg("decide"),
             py::arg("update"), py::arg("no_bonus_slot") = -1)
        .def("set_tokens", &PyRounds::set_tokens, py::arg("which"), py::arg("tokens"), "Record what a KV cache holds (0 target, 1 draft).")
        .def("limit", &PyRounds::limit, py::arg("which"), py::arg("n_ctx"), "Hold a context to fewer positions than its KV size.")
        .def("tokens", &PyRounds::tokens, py::arg("which"), "What a KV cache holds, position by position.")
        .def("set_history", &PyRounds::set_history, py::arg("history"), "The emitted history the next round continues.")
        .def("set_model_max", &PyRounds::set_model_max, py::arg("n"), "A drafting model drafts at most n tokens a round.")
        .def("set_lookup", &PyRounds::set_lookup, py::arg("ngram_min"), py::arg("ngram_max"),
             "Run the lookup drafter's n-gram search with these sizes (0, 0: no lookup).")
        .def(
            "set_slots",
            [](PyRounds& self, int offer_n, int offer_conf, int behind, int source, int t_catchup, int offer_match,
               int offer_reach) {
                self.set_slots(eesd::Slots{offer_n, offer_conf, behind, source, t_catchup, offer_match, offer_reach});
            },
            py::arg("offer_n"), py::arg("offer_conf"), py::arg("behind"), py::arg("source"), py::arg("t_catchup"),
            py::arg("offer_match") = -1, py::arg("offer_reach") = -1,
            "Where the controller's state holds the offer, the chosen source and the catch-up seconds (-1: none).")
        .def("set_reference", &PyRounds::set_reference, py::arg("reference"), py::arg("n_prompt"),
             "The request's predicted output: tokens proposed like lookup's while the answer (from history position "
             "n_prompt on) follows them; [] for none.")
        .def(
            "set_store",
            [](PyRounds& self, py::object store) {
                self.set_store(store.is_none() ? nullptr : &store.cast<eesd::Store&>());
                self.store = std::move(store);
            },
            py::arg("store"), "Earlier answers (a Store) that lookup searches beside the history; None: none.")
        .def("set_call", &set_call, py::arg("call"),
             "Mode 4's drafter, written in Python: call(new history tokens, max_n, rng state) -> (tokens, confidences, "
             "[q or None] or None, t_catchup, source, offer tokens, offer match, rng state), once a round (None: unset).")
        .def("set_hindsight", &PyRounds::set_hindsight, py::arg("hindsight"),
             "Report every lookup offer to the controller once emitted tokens resolve it: the controller's hindsight "
             "entry point (controllers.cfuncs), 0: off.")
        .def("room", &PyRounds::room, "How many more tokens fit into the target context.")
        .def(
            "set_split",
            [](PyRounds& self, uintptr_t trunk, int trunk_batch, uintptr_t capture, uintptr_t table, size_t row_bytes, int type,
               int64_t n_rows, int64_t n_embd, std::vector<int32_t> vocab, uintptr_t target_model) {
                eesd::EmbedTable t{reinterpret_cast<const char*>(table), row_bytes, type, n_rows, n_embd};
                self.set_split(trunk, trunk_batch, reinterpret_cast<eesd::Capture*>(capture), t, std::move(vocab),
                               reinterpret_cast<const llama_model*>(target_model));
            },
            py::arg("trunk"), py::arg("trunk_batch"), py::arg("capture"), py::arg("table"), py::arg("row_bytes"), py::arg("type"),
            py::arg("n_rows"), py::arg("n_embd"), py::arg("vocab"), py::arg("target_model"),
            "The target is split (trunk.py): this target context is the tail, fed the trunk's captured rows; the trunk "
            "(the draft context, side 1) is fed the embedding table's rows and drafts over vocab (V').")
        .def("configure", &configure, py::arg("state"), py::arg("mode"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
             py::arg("rng_state"), py::arg("budget_s"), py::arg("cancel"),
             "The settings of run_batch(): controller state, mode, sampling, random state, time budget, cancel flag.")
        .def("run_batch", &run_batch, py::arg("n_history"), py::arg("draft_max"), py::arg("left"), py::arg("max_rounds"),
             "Rounds until an end token, the token budget, max_rounds, the time budget or the cancel flag: "
             "[(drafted, accepted, next token, t_draft, t_verify, max_n, room, source)].")
        .def("rng_state", &PyRounds::rng_state, "The random stream's state after the batches so far.")
        .def_property_readonly("t_llama", &PyRounds::t_llama, "Seconds inside llama_decode over all batches.")
        .def("close", &PyRounds::close, "Free the batches; the contexts stay with Python.");
    py::class_<eesd::Store>(m, "Store")
        .def(py::init<size_t, int>(), py::arg("limit"), py::arg("n"),
             "Earlier answers for lookup across requests: at most limit tokens, matches of at least n tokens.")
        .def(
            "add", [](eesd::Store& self, const std::vector<llama_token>& toks) { self.add(toks.data(), toks.size()); },
            py::arg("tokens"), "Keep an entry: a prompt's end and its answer.")
        .def(
            "find",
            [](const eesd::Store& self, const std::vector<llama_token>& history, int max_n, int cap) {
                std::vector<llama_token> out;
                double share = 0.0;
                int l = self.find(history.data(), static_cast<int>(history.size()), max_n, cap, out, share);
                return py::make_tuple(out, l, share);
            },
            py::arg("history"), py::arg("max_n"), py::arg("cap") = eesd::MATCH_CAP,
            "(continuation, match length, share of the longest matches that went on with its first token).")
        .def_property_readonly("size", &eesd::Store::size, "Tokens held.")
        .def_property_readonly("entries", &eesd::Store::entries, "Entries held.");
    py::class_<eesd::Capture>(m, "Capture")
        .def(py::init<std::string, int64_t>(), py::arg("name"), py::arg("n_embd"))
        .def_property_readonly_static(
            "callback", [](py::object) { return reinterpret_cast<uintptr_t>(&eesd::capture_eval); },
            "The cb_eval function's address (for llama_context_params.cb_eval).")
        .def_property_readonly(
            "user_data", [](eesd::Capture& self) { return reinterpret_cast<uintptr_t>(&self); },
            "This capture's address (for llama_context_params.cb_eval_user_data); keep the object alive.")
        .def("reset", &eesd::Capture::reset, "Forget the rows captured so far.")
        .def_readonly("n_rows", &eesd::Capture::n_rows)
        .def_readonly("n_bad", &eesd::Capture::n_bad)
        .def_readonly("name", &eesd::Capture::name)
        .def(
            "take",
            [](eesd::Capture& self) {
                py::array_t<float> out({static_cast<py::ssize_t>(self.n_rows), static_cast<py::ssize_t>(self.n_embd)});
                std::copy(self.rows.begin(), self.rows.begin() + self.n_rows * self.n_embd, out.mutable_data());
                self.reset();
                return out;
            },
            "The rows captured since the last reset, as an (n_rows, n_embd) float32 array; then reset.");
    m.def(
        "embed_rows",
        [](uintptr_t table, size_t row_bytes, int type, int64_t n_rows, int64_t n_embd, const std::vector<int32_t>& ids) {
            eesd::EmbedTable t{reinterpret_cast<const char*>(table), row_bytes, type, n_rows, n_embd};
            if (!t.valid()) throw py::value_error("cannot dequantize ggml type " + std::to_string(type));
            for (int32_t id : ids)
                if (id < 0 || id >= n_rows) throw py::value_error("token id " + std::to_string(id) + " out of range");
            py::array_t<float> out({static_cast<py::ssize_t>(ids.size()), static_cast<py::ssize_t>(n_embd)});
            t.rows(ids.data(), ids.size(), out.mutable_data());
            return out;
        },
        py::arg("table"), py::arg("row_bytes"), py::arg("type"), py::arg("n_rows"), py::arg("n_embd"), py::arg("ids"),
        "Rows ids of the embedding table at address table (n_rows rows of row_bytes bytes, ggml type) as float32, "
        "dequantized by ggml's type traits (what get_rows computes).");
    m.def(
        "lookup",
        [](const std::vector<llama_token>& history, int ngram_min, int ngram_max, int max_n) {
            if (ngram_min < 1 || ngram_min > ngram_max) throw py::value_error("lookup n-grams need 1 <= ngram_min <= ngram_max");
            std::vector<llama_token> out;
            int match = 0;
            int n = eesd::lookup_match(history.data(), static_cast<int>(history.size()), ngram_min, ngram_max, max_n, out, match);
            return py::make_tuple(out, n, match);
        },
        py::arg("history"), py::arg("ngram_min"), py::arg("ngram_max"), py::arg("max_n"),
        "Prompt lookup over history: (continuation of up to max_n tokens, n of the matched n-gram, match length); "
        "an ambiguous n-gram's match length is 1.");
    m.def(
        "reference_at",
        [](const std::vector<llama_token>& history, int n_answer, const std::vector<llama_token>& reference, int expect,
           int min_match, int cap) {
            if (n_answer < 0 || n_answer > static_cast<int>(history.size())) throw py::value_error("n_answer must be within the history");
            int match = 0;
            int at = eesd::reference_at(history.data(), static_cast<int>(history.size()), n_answer, reference.data(),
                                        static_cast<int>(reference.size()), expect, min_match, cap, match);
            return py::make_tuple(at, match);
        },
        py::arg("history"), py::arg("n_answer"), py::arg("reference"), py::arg("expect"), py::arg("min_match"), py::arg("cap"),
        "Where a prediction (reference) goes on after history, whose last n_answer tokens are the answer so far, as the "
        "round realigns it: (position, -1 for nowhere; the match's length).");
    m.def("match_confidence", &eesd::match_confidence, py::arg("n"), py::arg("ngram_max"),
          "A matched n-gram's confidence, n / (ngram_max + 1); 0 for no match.");
    m.def(
        "pick",
        [](const Logits& logits, double temperature, int top_k, double top_p, uint64_t rng_state) {
            const float* row = logit_row(logits);
            eesd::TokenRng rng{rng_state};
            eesd::Verifier v;
            int tok = v.pick(row, static_cast<int>(logits.shape(0)), eesd::sampling_of(temperature, top_k, top_p), rng);
            return py::make_tuple(tok, rng.s);
        },
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("rng_state"),
        "(token, rng state): the argmax at temperature 0, else a draw from the processed distribution.");
    m.def(
        "verify",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> rows, const std::vector<llama_token>& drafts, py::object qs,
           double temperature, int top_k, double top_p, uint64_t rng_state, bool bonus) {
            if (rows.ndim() != 2) throw py::value_error("rows must be a 2-d array (rows x vocabulary)");
            int k = static_cast<int>(drafts.size());
            int n = static_cast<int>(rows.shape(1));
            if (rows.shape(0) < (bonus ? k + 1 : std::max(k, 1))) throw py::value_error("too few rows for the drafts");
            std::vector<char> point(k, 1);
            std::vector<eesd::Dist> q(k);
            if (!qs.is_none()) {
                py::list ql = qs.cast<py::list>();
                if (static_cast<int>(ql.size()) != k) throw py::value_error("one q (or None) per draft");
                for (int i = 0; i < k; i++) {
                    if (ql[i].is_none()) continue;
                    auto a = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(ql[i]);
                    if (!a || a.ndim() != 1 || a.shape(0) != n) throw py::value_error("q must be a 1-d array over the vocabulary");
                    point[i] = 0;
                    q[i].v.assign(a.data(), a.data() + n);
                }
            }
            for (llama_token d : drafts)
                if (d < 0 || d >= n) throw py::value_error("draft token out of range");
            const float* base = rows.data();
            auto row = [base, n](int i) { return base + static_cast<size_t>(i) * n; };
            eesd::Sampling sp = eesd::sampling_of(temperature, top_k, top_p);
            eesd::TokenRng rng{rng_state};
            int m = 0, nxt = 0;
            if (sp.greedy) {
                eesd::Verifier::greedy(row, n, drafts.data(), k, bonus, m, nxt);
            } else {
                eesd::Verifier v;
                v.sampled(row, n, sp, drafts.data(), point.data(), q, k, bonus, rng, m, nxt);
            }
            return py::make_tuple(m, nxt, rng.s);
        },
        py::arg("rows"), py::arg("drafts"), py::arg("qs"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("rng_state"), py::arg("bonus") = true,
        "The round's verification of drafts against the target's rows: (accepted, next token, rng state); qs: q per "
        "draft, None for a point proposal (or None for all).");
    m.def(
        "random",
        [](uint64_t state) {
            eesd::TokenRng rng{state};
            double u = rng.random();
            return py::make_tuple(u, rng.s);
        },
        py::arg("state"), "(u in [0, 1), next state): one draw of the token sampler's splitmix64 stream.");
    m.def(
        "splitmix64",
        [](uint64_t state) {
            eesd::TokenRng rng{state};
            uint64_t z = rng.next();
            return py::make_tuple(z, rng.s);
        },
        py::arg("state"), "(z, next state): one 64-bit output of splitmix64 (the controllers' seeding draws four words from it).");
    m.def("round_limit", &eesd::round_limit, py::arg("draft_max"), py::arg("left"), py::arg("room"),
          "Most tokens a round may draft: max(0, min(draft_max, left - 1, room - 1)).");
    m.def("probs", &probs, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"));
    m.def(
        "argmax", [](const Logits& logits) { return eesd::argmax(logit_row(logits), static_cast<int>(logits.shape(0))); },
        py::arg("logits"), "The first index of the largest logit (as numpy.argmax), for tests.");
}
