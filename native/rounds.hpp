// The speculative round loop in C++ (eesd_local._native.Rounds): draft, one batched verify,
// accept, KV rollback, against the libllama that llama-cpp-python loaded. The contexts belong
// to Python (their pointers arrive as integers); the controller is the Numba code of
// eesd_local.speculative.controllers, called through cfunc pointers on its float64 state array.
// This is the only round loop: every drafter runs here (a drafter written in Python through one
// call a round, mode CALL), and every rule of the round is written once, here and in verify.hpp.
//
// Nothing here knows Python: errors a caller can cause are std::invalid_argument (ValueError
// once bound), and the bindings (module.cpp) keep the arrays alive whose data this reads.
#pragma once

#include <llama.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <vector>

#include "capture.hpp"
#include "kv.hpp"
#include "probs.hpp"
#include "store.hpp"
#include "verify.hpp"

namespace eesd {

// Most tokens a round may draft (eesd_local.speculative.rounds.round_limit): a round emits up to k + 1
// tokens, so k <= left - 1 (tokens still wanted) and k <= room - 1 (free KV positions after
// `last`), and never more than draft_max
inline int round_limit(int draft_max, int left, int room) { return std::max(0, std::min({draft_max, left - 1, room - 1})); }

// the controller's kernels (controllers.cfuncs): begin a round; draft token i with this
// confidence?; learn from the round (confidences, accepted, t_draft, t_verify)
using begin_fn = void (*)(double*, int64_t);
using decide_fn = int64_t (*)(double*, int64_t, int64_t, double);
using update_fn = void (*)(double*, int64_t, double*, int64_t, int64_t, double, double);
// a free offer seen in hindsight (match length, tokens offered, tokens of it the target emitted)
using hindsight_fn = void (*)(double*, int64_t, int64_t, int64_t, int64_t);

// no drafter; fixed proposals (lookup); a draft model (lookup's proposals, if any, are its guesses);
// the controller picks one source per round (lookup alone or the draft model alone); a drafter
// written in Python, called once a round (set_call)
enum Mode { NONE = 0, POINT = 1, MODEL = 2, CHOOSE = 3, CALL = 4 };
// the sources, as the controller's SOURCE slot numbers them (controllers/layout.py SRC_*)
enum Source { SRC_ANY = -2, SRC_NONE = -1, SRC_LOOKUP = 0, SRC_MODEL = 1 };
// what a round reports when its lookup proposals came from the request's prediction (the controller sees
// them as lookup's: free proposals)
constexpr int SRC_PREDICTION = 2;
// ... and when they came from the store of earlier answers (Store)
constexpr int SRC_STORE = 3;
// a prediction realigns with the answer on a match of at least this many tokens
constexpr int REF_MIN_MATCH = 3;
// prompt lookup and the store of earlier answers offer a continuation only where the context matches its source
// for at least this many tokens (an ambiguous n-gram counts as one). The match-length classes pool requests: code's
// short matches run on, prose's do not, and a chat answer right after a code request drafted 3-7 tokens on 2-3 token
// matches that failed. Measured in process (code, then three chat requests, each three times, median, both orders of
// none and auto): chat-explain 0.91 and 0.90 of plain before, 0.95 and 1.01 with this floor; the price, code 2.37 and
// 2.51 before, 2.36 and 2.20 after, chat-writing 1.23 before, 1.20 and 1.19 after (a floor of 6 fixed chat-explain no
// better and cost code 9%). llama.cpp's n-gram types wait for 12 or 24 matching tokens. A request's prediction is
// exempt: its realignments are short by rule.
constexpr int LOOKUP_MIN_MATCH = 4;

// state slots the loop writes before a round (the offer), reads after begin (source) and writes
// before update (catch-up seconds); -1: not written (controllers/layout.py)
struct Slots {
    int offer_n = -1, offer_conf = -1, behind = -1, source = -1, t_catchup = -1, offer_match = -1, offer_reach = -1;
};

// What a drafter written in Python drafted in one round (mode CALL). Its call does the round's
// beginning too: the drafter's offer, the controller's begin (in place on the same state), and the
// proposal with the controller deciding token by token.
struct Called {
    std::vector<llama_token> toks;
    std::vector<double> conf;             // the controller's confidence in each draft
    std::vector<std::vector<double>> q;   // q of each draft over the vocabulary; empty: a point proposal
    double t_catchup = 0.0;               // seconds of it spent catching up (charged to resuming)
    int src = SRC_NONE;                   // the source that drafted
    std::vector<llama_token> offer;       // a free offer, learned in hindsight (set_hindsight), and its match
    int offer_match = 0;
};
// (the history's tokens since the last call, how many, the draft limit, the random stream, out)
using call_fn = std::function<void(const llama_token*, size_t, int, TokenRng&, Called&)>;

// What one round of a batch did; its drafts are Rounds::drafted()[first, next round's first)
struct RoundOut {
    int m = 0;      // d1..dm were accepted
    int nxt = 0;    // the target's token after them (-1: none, a probe's)
    int src = SRC_NONE;  // the source that drafted (SRC_NONE: nothing drafted)
    int max_n = 0;  // the draft limit it ran with
    int room = 0;   // free target KV positions before it
    int first = 0;
    int rows = 0;   // tokens in its verify batch: [last, d1..], k + 1 (k without the bonus)
    double t_draft = 0.0, t_verify = 0.0;
};

// The round loop's state between calls: both contexts, the history, the batches' settings,
// scratch buffers reused from round to round.
class Rounds {
  public:
    // target and draft are llama_context pointers (draft 0: none); no_bonus_slot is the state
    // slot that says "verify this round without the bonus token" (-1: never)
    Rounds(uintptr_t target, int target_batch, uintptr_t draft, int draft_batch, uintptr_t f_begin, uintptr_t f_decide,
           uintptr_t f_update, int no_bonus_slot);
    ~Rounds() { close(); }
    Rounds(const Rounds&) = delete;
    Rounds& operator=(const Rounds&) = delete;

    void close();  // free the batches; the contexts stay with Python

    void set_tokens(int which, std::vector<llama_token> toks) { side(which).tokens = std::move(toks); }
    // llama.cpp pads the KV size; the engine holds a context to the n_ctx it asked for
    void limit(int which, int n_ctx) { side(which).n_ctx = std::min(side(which).n_ctx, n_ctx); }
    std::vector<llama_token> tokens(int which) { return side(which).tokens; }
    void set_history(std::vector<llama_token> h) {
        history_ = std::move(h);
        call_seen_ = 0;
    }
    // the request's predicted output (OpenAI's predicted outputs): the answer's expected tokens, proposed like
    // lookup's while the answer follows them (n_prompt: where the answer starts in the history); empty: none
    void set_reference(std::vector<llama_token> ref, size_t n_prompt) {
        ref_ = std::move(ref);
        ref_prompt_ = n_prompt;
        ref_expect_ = 0;
        ref_expect_len_ = static_cast<int>(n_prompt);
    }
    // earlier answers of this process, searched beside the history where lookup drafts (nullptr: none); the
    // store outlives the rounds (the engine holds it)
    void set_store(const Store* store) { store_ = store; }
    // the drafter of mode CALL: f runs once a round (with the GIL: module.cpp)
    void set_call(call_fn f) { call_ = std::move(f); }
    int room() { return open_target().room(); }
    // the lookup drafter's n-gram sizes: its search runs here, on the history this loop holds (0, 0: off)
    void set_lookup(int ngram_min, int ngram_max);
    // a drafting model drafts at most n tokens a round (free offers: up to the round's limit)
    void set_model_max(int n) { model_max_ = std::max(0, n); }
    // where the offer, the source and the catch-up time live in the controller's state
    void set_slots(const Slots& s) { slots_ = s; }
    // Report every lookup offer to the controller once the emitted tokens resolve it (rounds.Hindsight):
    // f is controllers.cfuncs' hindsight entry point (0: off)
    void set_hindsight(uintptr_t f) {
        hindsight_ = reinterpret_cast<hindsight_fn>(f);
        offers_.clear();
    }
    // The shared trunk (trunk.py's SplitTarget): the target context is the tail, fed the rows the
    // trunk's capture copies out; the trunk (opened here as the draft context, side 1) is fed the
    // table's embedding rows and drafts over vocab (V' ids in target numbering); end-of-generation
    // tokens are the target model's (the tail has no tokenizer).
    void set_split(uintptr_t trunk, int trunk_batch, Capture* cap, const EmbedTable& table, std::vector<int32_t> vocab,
                   const llama_model* target_model);

    // The batches' settings: the controller's state (written in place), the drafting mode, the
    // sampling parameters, the random stream's state, the time budget of a batch, and a flag
    // that another thread may set to end a batch (*cancel != 0). state and cancel must outlive
    // the batches.
    void configure(double* state, int64_t n_state, int mode, const Sampling& sp, uint64_t rng_state, double budget_s,
                   const volatile uint8_t* cancel);

    // Rounds one after another (configure() first), as the engine would ask for them: round r
    // drafts at most round_limit(draft_max, left_r, room_r), and the batch ends after a round
    // that emits an end-of-generation token, when no token is wanted or fits any more, after
    // max_rounds, once the time budget has passed, or when the cancel flag is set. The rounds
    // are in batch() and drafted(). An error in a round after the first ends the batch with the
    // rounds before it; the next call raises it.
    void run_batch(size_t n_history, int draft_max, int left, int max_rounds);
    const std::vector<RoundOut>& batch() const { return recs_; }
    const std::vector<llama_token>& drafted() const { return rec_tok_; }

    uint64_t rng_state() const { return rng_.s; }
    double t_llama() const { return t_llama_; }  // seconds inside llama_decode over all batches

  private:
    void one_round(int max_n, RoundOut& r);
    int draft(int max_n, double conf, int mode);
    void see_offers();
    int behind() const;
    void put(int slot, double v) {
        if (slot >= 0 && slot < n_st_) st_[slot] = v;
    }
    void propose_point(int max_n, double conf);
    void propose_model(int max_n, bool guesses);
    llama_token pick(const float* row, llama_token guess, size_t j, double& conf);
    void add(llama_token tok, bool point, double conf);
    void propose_called(int max_n);
    bool propose_reference(int max_n);

    // the target's decode and rollback, and the draft context's, whether the target is split or not
    void target_decode(const llama_token* toks, int n, int n_logits);
    void target_trim(size_t n_keep);
    void draft_decode(const llama_token* toks, int n, int n_logits);
    void draft_trim(size_t n_keep);

    void check_call(size_t n_history);
    void check_mode(int mode) const;
    void check_fits(int max_n) const;
    Ctx& side(int which);
    Ctx& open_target();

    Ctx tgt_, dft_;
    begin_fn begin_;
    decide_fn decide_;
    update_fn update_;
    int no_bonus_slot_ = -1;
    Slots slots_;
    double t_catchup_ = 0.0;  // this round's draft model catch-up seconds
    int ngram_min_ = 0, ngram_max_ = 0;
    int match_len_ = 0;  // the last lookup's match length (up to MATCH_CAP)
    int model_max_ = 1 << 30;  // most tokens a drafting model drafts a round (set_model_max)
    hindsight_fn hindsight_ = nullptr;
    struct PendingOffer {
        size_t start;  // history length when offered
        std::vector<llama_token> toks;
        int match;
        size_t reported = 0;  // its first tokens the target emitted, reported already (see_offers)
    };
    std::vector<PendingOffer> offers_;  // lookup offers not yet resolved by emitted tokens
    bool covered(size_t start, const std::vector<llama_token>& toks) const;
    std::vector<llama_token> history_;
    const Store* store_ = nullptr;
    std::vector<llama_token> stored_;  // scratch: the store's continuation
    std::vector<llama_token> ref_;  // the request's prediction (set_reference)
    size_t ref_prompt_ = 0;
    int ref_expect_ = 0;            // where in ref_ the last alignment said the answer goes on,
    int ref_expect_len_ = 0;        // at this history length
    call_fn call_;          // mode CALL's drafter
    size_t call_seen_ = 0;  // history tokens it has been given
    Called called_;

    // the shared trunk (set_split)
    bool split_ = false;
    Capture* cap_ = nullptr;
    EmbedTable table_;
    std::vector<int32_t> vocab_;   // V' index -> target token
    int n_target_ = 0;             // the target's vocabulary size
    const llama_vocab* eog_vocab_ = nullptr;
    std::vector<float> h_;         // h_N rows of trunk positions [h_base_, h_base_ + rows)
    size_t h_base_ = 0;
    std::vector<float> emb_, full_;  // scratch: embedding rows; a V' row spread over the target's vocabulary

    // configure(): the batches' settings
    bool configured_ = false;
    double* st_ = nullptr;
    int64_t n_st_ = 0;
    int mode_ = NONE;
    Sampling sp_ = sampling_of(0.0, 0, 1.0);
    TokenRng rng_{0};
    double budget_s_ = 0.0;
    const volatile uint8_t* cancel_ = nullptr;

    // the last batch: its rounds and their drafts; an error in a later round, raised by the next call
    std::vector<RoundOut> recs_;
    std::vector<llama_token> rec_tok_;
    std::exception_ptr pending_;
    double t_llama_ = 0.0;

    // the current round
    std::vector<llama_token> drafted_, cands_, batch_, feed_;  // drafts; lookup proposals; verify batch; draft feed
    std::vector<double> conf_;  // the controller's confidence in each draft
    std::vector<char> point_;   // 1: the draft was proposed deterministically (q = point mass)
    std::vector<Dist> q_;       // q of each draft (sampling with a draft model)
    std::vector<double> blocks_;
    Probs probs_;
    Verifier ver_;
};

}  // namespace eesd
