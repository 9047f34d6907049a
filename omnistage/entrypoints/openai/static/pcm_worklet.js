// The microphone's AudioWorklet: hands each block of samples (Float32, the context's rate) to
// the page, which resamples it to PCM16 for input_audio_buffer.append (16 kHz on
// /v1/realtime, the model's 24 kHz on /v1/duplex).
class PcmCapture extends AudioWorkletProcessor {
  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) this.port.postMessage(channel.slice(0));
    return true;
  }
}
registerProcessor("pcm-capture", PcmCapture);
